"""What an engine's tiers hold, read from the engine itself, in Dynamo's terms.

Dynamo's indexer answers per instance, in tokens, the longest prefix held by
a tier or a faster one (``gpu <= cpu <= disk``). :func:`engine_overlap` computes
the same numbers from the engine's own state (its block pool, CPU manager and
disk tier), never from its events, so a comparison tests the events.

Prompts for the comparison (:func:`probe_prompts`) are built from the chains
the engine served: whole conversations (held in some tier, or evicted from
all), the same with one token changed in the middle (perturbed) and random
token lists; :func:`classify` names what a prompt exercises.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.bench.routing.indexer import TierOverlap
from kvoffload.engine.llm_engine import LLMEngine
from kvoffload.hashing import hash_request_tokens
from kvoffload.offload.base import make_offload_key


@dataclass(frozen=True)
class Probe:
    kind: str  # "trace", "perturbed" or "random"
    token_ids: list[int]


def _prefix(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def tier_flags(engine: LLMEngine, token_ids: Sequence[int]) -> dict[str, list[bool]]:
    """Per full block of ``token_ids``: held by the GPU, CPU and local-disk tiers."""
    cfg = engine.config
    hashes = hash_request_tokens(token_ids, cfg.block_size, engine.hash_fn, parent=engine.none_hash)
    gpu = [engine.pool.get_cached_block(h) is not None for h in hashes]
    cpu = [False] * len(hashes)
    disk = [False] * len(hashes)
    if engine.offload is not None:
        manager = engine.offload.manager
        keys = [make_offload_key(h) for h in hashes]
        cpu_tier = getattr(manager, "cpu", manager)
        cpu = [cpu_tier.is_stored(k) for k in keys]
        for tier in getattr(manager, "lower", ()):
            if tier.medium == "DISK":
                disk = list(tier.stored_mask(keys))
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


def staged_overlap(flags: dict[str, list[bool]], block_size: int) -> TierOverlap:
    """Dynamo 1.6.1's per-tier overlap of a prompt whose blocks are held as ``flags`` say.

    Dynamo walks the chain in stages: ``gpu`` is the leading run of GPU blocks,
    ``cpu`` goes on from there with the run of CPU blocks, ``disk`` goes on from
    there with the run of disk blocks (a block counts in every tier that holds
    it). A chain that goes back to a faster tier after a disk run stops there,
    though the engine loads the union (each block from the fastest tier holding
    it): pinned against the real indexer in ``test_dynamo_semantics.py``.
    """
    n = len(flags["gpu"])
    i = 0
    ends = []
    for tier in ("gpu", "cpu", "disk"):
        held = flags[tier]
        while i < n and held[i]:
            i += 1
        ends.append(i * block_size)
    return TierOverlap(longest_matched=ends[2], gpu=ends[0], cpu=ends[1], disk=ends[2])


def union_overlap(flags: dict[str, list[bool]], block_size: int) -> int:
    """Tokens of the leading run held by any tier: what the engine itself can load."""
    return _prefix([any(f) for f in zip(flags["gpu"], flags["cpu"], flags["disk"])]) * block_size


def engine_overlap(engine: LLMEngine, token_ids: Sequence[int]) -> TierOverlap:
    """Dynamo's answer for ``token_ids`` if its index equals the engine's tiers."""
    return staged_overlap(tier_flags(engine, token_ids), engine.config.block_size)


def classify(truth: TierOverlap) -> str:
    """What a prompt exercises: where its held prefix ends."""
    if truth.disk == 0:
        return "none held"
    if truth.disk > truth.cpu:
        return "beyond CPU on disk"
    if truth.cpu > truth.gpu:
        return "CPU beyond GPU" if truth.gpu else "CPU only"
    return "GPU"


def probe_prompts(
    chains: Sequence[Sequence[int]], vocab_size: int, block_size: int, seed: int = 0
) -> list[Probe]:
    """Every distinct chain, each perturbed once past its first block, and random prompts."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    probes: list[Probe] = []
    for chain in chains:
        key = tuple(chain)
        if key in seen or len(chain) < block_size:
            continue
        seen.add(key)
        probes.append(Probe("trace", list(chain)))
        changed = list(chain)
        at = rng.randrange(min(block_size, len(chain) - 1), len(chain))
        changed[at] = (changed[at] + 1) % vocab_size
        probes.append(Probe("perturbed", changed))
    for _ in range(max(4, len(probes) // 8)):
        n = rng.randrange(block_size, 8 * block_size)
        probes.append(Probe("random", [rng.randrange(vocab_size) for _ in range(n)]))
    return probes
