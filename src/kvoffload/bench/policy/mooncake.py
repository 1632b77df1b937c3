"""Replay a Mooncake-format trace through the GPU block pool and the CPU tier, no model.

A Mooncake trace is JSON lines with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``: one id per block of the prompt, equal ids
meaning equal prefix blocks (the ids are already chained). Replaying it
through ``BlockPool`` and an ``OffloadingManager`` measures prefix hit rates
at a scale the reference model cannot serve on a CPU.

Only each request's full blocks are replayed (``input_length // block_size``
of its ids; the last id of a Mooncake request is usually a partial block,
which an engine never hashes). Requests are replayed in timestamp order;
each holds its blocks for ``hold_requests`` later arrivals (a crude stand-in
for its decode time) and is then freed, tail first. Per request, as vLLM's
offloading connector drives its tiers: the GPU prefix cache is looked up; the
CPU tier is looked up for the blocks after the GPU hit and the hit is loaded; every block of the
request is touched in the CPU tier (a full GPU hit included); then the
request's blocks, GPU hits too, are offered to the CPU tier
(``admit`` first, as kvoffload's connector: only the keys the tier admits
go to ``prepare_store``, which keeps those it does not hold yet), eagerly, or,
in ``lazy`` mode, each cached GPU block is offered just before its eviction.
A store the tier refuses for lack of room is counted, never dropped in
silence, and no request is ever truncated: one longer than the GPU tier is a
``ValueError``.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.hashing import BlockHash
from kvoffload.offload import CPUOffloadingManager, OffloadKey, make_offload_key
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY


@dataclass(frozen=True)
class MooncakeRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_mooncake_trace(path: str | Path) -> Iterator[MooncakeRequest]:
    """Parse a trace, with the line number in every error."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = MooncakeRequest(
                    timestamp=float(obj["timestamp"]),
                    input_length=int(obj["input_length"]),
                    output_length=int(obj["output_length"]),
                    hash_ids=[int(h) for h in obj["hash_ids"]],
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            if req.input_length < 0 or req.output_length < 0:
                raise ValueError(f"{path}:{lineno}: negative length")
            yield req


@dataclass
class ReplayResult:
    requests: int = 0
    blocks: int = 0
    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0
    blocks_offered: int = 0  # keys handed to prepare_store
    blocks_stored: int = 0  # keys the tier took (not already there)
    stores_refused: int = 0  # keys offered when prepare_store found no room
    stores_declined: int = 0  # keys the tier's admission declined (never offered to it)
    block_ops: int = 0  # keys handed to CPU-tier manager calls
    seconds: float = 0.0

    @property
    def hit_rate_gpu(self) -> float:
        return self.gpu_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_cpu(self) -> float:
        return self.cpu_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.block_ops / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        rates = {"hit_rate_gpu": self.hit_rate_gpu, "hit_rate_cpu": self.hit_rate_cpu}
        rates["hit_rate_total"] = self.hit_rate_gpu + self.hit_rate_cpu
        return {**asdict(self), **rates, "ops_per_s": self.ops_per_s}


def full_blocks(req: MooncakeRequest, block_size: int = 512) -> list[int]:
    """The ids of ``req``'s full blocks: the first ``input_length // block_size``.

    Mooncake traces give ``ceil(input_length / block_size)`` ids; the last is
    usually a partial block, which an engine never hashes, stores or looks up.
    """
    return req.hash_ids[: req.input_length // block_size]


def _hash(block_id: int) -> BlockHash:
    return BlockHash(block_id.to_bytes(8, "big", signed=True))


def longest_request(requests: Sequence[MooncakeRequest], block_size: int = 512) -> int:
    """Full blocks of the longest request (0 for an empty trace)."""
    return max((len(full_blocks(r, block_size)) for r in requests), default=0)


def unique_blocks(requests: Sequence[MooncakeRequest], block_size: int = 512) -> int:
    """Distinct full blocks over the trace."""
    return len({h for r in requests for h in full_blocks(r, block_size)})


def check_block_size(requests: Sequence[MooncakeRequest], block_size: int) -> None:
    """``ValueError`` unless ``block_size`` tokens per id matches the trace's lengths.

    A request of ``input_length`` tokens has ``ceil(input_length / block_size)``
    ids (a partial last block included, as Mooncake's traces count them); a
    block size that disagrees for most requests is not the trace's.
    """
    checked = [r for r in requests if r.input_length > 0]
    if not checked:
        return
    agree = sum(math.ceil(r.input_length / block_size) == len(r.hash_ids) for r in checked)
    if agree < 0.9 * len(checked):
        sizes = sorted({r.input_length // len(r.hash_ids) for r in checked if r.hash_ids} - {0})[
            -1:
        ]
        hint = f" (about {sizes[0]} tokens per id)" if sizes else ""
        raise ValueError(
            f"--block-size {block_size} does not match the trace: only {agree:,} of "
            f"{len(checked):,} requests have ceil(input_length / {block_size}) hash ids{hint}"
        )


def _offer(manager: CPUOffloadingManager, res: ReplayResult, keys: list[OffloadKey]) -> None:
    """Offer ``keys`` for storing, as kvoffload's connector does: only admitted keys."""
    if not keys:
        return
    res.blocks_offered += len(keys)
    res.block_ops += len(keys)
    flags = manager.admit(keys)
    if flags is not None:
        keys = [k for k, f in zip(keys, flags) if f]
        res.stores_declined += len(flags) - len(keys)
        if not keys:
            return
    out = manager.prepare_store(keys)
    if out is None:
        res.stores_refused += len(keys)
        return
    if out.keys_to_store:
        manager.complete_store(keys)
        res.blocks_stored += len(out.keys_to_store)
        res.block_ops += len(out.keys_to_store)


def _cpu_hit(
    manager: CPUOffloadingManager, res: ReplayResult, all_keys: list[OffloadKey], gpu_hits: int
) -> int:
    """Blocks past the GPU hit found (and loaded) in the CPU tier; every block is touched."""
    cpu_hit = 0
    rest = all_keys[gpu_hits:]
    if rest:
        cpu_hit = manager.lookup(rest)
        res.block_ops += min(cpu_hit + 1, len(rest))
    if cpu_hit:
        manager.prepare_load(rest[:cpu_hit])
        manager.complete_load(rest[:cpu_hit])
        res.block_ops += 2 * cpu_hit
    # Every block the request uses is recent in the CPU tier too, a full GPU hit included.
    manager.touch(all_keys)
    res.block_ops += len(all_keys)
    return cpu_hit


def _doomed(pool: BlockPool, count: int) -> list[OffloadKey]:
    """Keys of the cached blocks among the first ``count`` of the free queue (evicted next)."""
    doomed = []
    for i, b in enumerate(pool.free_block_queue.iter_blocks_after(None)):
        if i >= count:
            break
        if b.block_hash is not None:
            doomed.append(make_offload_key(b.block_hash))
    return doomed


def replay_mooncake(
    requests: Sequence[MooncakeRequest],
    num_gpu_blocks: int,
    num_cpu_blocks: int | None,
    cache_policy: str | None = None,
    hold_requests: int = 8,
    store_mode: str = "eager",
    block_size: int = 512,
) -> ReplayResult:
    """Hit rates of ``requests`` with a GPU tier of ``num_gpu_blocks`` and a CPU tier.

    Only each request's full blocks are replayed (``full_blocks``).
    ``num_cpu_blocks`` None or ``store_mode == "off"``: GPU tier only.
    ``store_mode``: ``eager`` offers each request's blocks after it is
    computed, ``lazy`` offers cached GPU blocks as they are about to be evicted.
    """
    if store_mode not in ("off", "eager", "lazy"):
        raise ValueError(f"store mode must be off, eager or lazy, got {store_mode!r}")
    if hold_requests < 1:
        raise ValueError(f"hold_requests must be >= 1, got {hold_requests}")
    longest = longest_request(requests, block_size)
    if longest > num_gpu_blocks - 1:
        raise ValueError(
            f"the trace's longest request has {longest:,} blocks but a GPU tier of "
            f"{num_gpu_blocks:,} blocks holds at most {num_gpu_blocks - 1:,} (block 0 is "
            f"the null block); use --gpu-blocks >= {longest + 1:,}"
        )
    pool = BlockPool(num_gpu_blocks)
    manager = None
    if num_cpu_blocks and store_mode != "off":
        manager = CPUOffloadingManager(num_cpu_blocks, cache_policy or DEFAULT_CACHE_POLICY)
    res = ReplayResult()
    held: deque[list[KVCacheBlock]] = deque()
    start = time.perf_counter()
    for req in sorted(requests, key=lambda r: r.timestamp):
        hashes = [_hash(h) for h in full_blocks(req, block_size)]
        n = len(hashes)
        while held and (len(held) >= hold_requests or pool.get_num_free_blocks() < n):
            pool.free_request_blocks(held.popleft())
        hits: list[KVCacheBlock] = []
        for h in hashes:
            b = pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        all_keys = [make_offload_key(h) for h in hashes]
        cpu_hit = 0
        if manager is not None and all_keys:
            cpu_hit = _cpu_hit(manager, res, all_keys, len(hits))
        pool.touch(hits)
        if manager is not None and store_mode == "lazy":
            # Cached blocks at the front of the free queue are about to be evicted: offer them.
            _offer(manager, res, _doomed(pool, n - len(hits)))
        blocks = hits + pool.get_new_blocks(n - len(hits))
        pool.cache_full_blocks(blocks, hashes, len(hits), n, 1)
        if manager is not None and store_mode == "eager":
            # As vLLM's connector does: the request's blocks, GPU hits included, are
            # offered; the tier keeps the ones it does not hold yet.
            _offer(manager, res, all_keys)
        held.append(blocks)
        res.requests += 1
        res.blocks += n
        res.gpu_hit_blocks += len(hits)
        res.cpu_hit_blocks += cpu_hit
    res.seconds = time.perf_counter() - start
    return res
