"""Which sliding-window chunks a request's store offers: vLLM 0.33's rule and kvoffload's.

The hybrid replay (``hybrid_replay``) stores every full-attention chunk from
the hit on; for a windowed group it stores what the store rule keeps:

- ``dense``: every chunk (vLLM with ``prefix_cache_retention_interval=None``);
- ``vllm``: vLLM 0.33's default (``prefix_cache_retention_interval=0``): the
  window ending at the last prompt token's chunk boundary only
  (``(tokens - 1) // T`` chunks; the GPU prefix-cache junction vLLM also keeps
  does not arise in a CPU-only replay);
- ``windows``: kvoffload's ``KVOffloadConnector`` default
  (``integrations.vllm.groups.window_keep``): vLLM's window, plus the window
  ending at every *junction* (a full-attention chunk after which some
  request's lookup found the next chunk missing: prompts part there), plus
  one every ``every`` chunks (0: none). Extra windows are offered with the
  rest of the request's keys; kvoffload's chunk-unit policy holds the ones a
  known boundary reaches and evicts the others first.

A boundary ``b`` (in chunks) keeps a group of ``w`` chunks' keys of chunks
``[b - w, b)`` that the store covers (``[hit, n)``), exactly the arithmetic of
vLLM's ``reachable_block_mask`` at one block per chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.offload import OffloadKey

#: Junction chunk ids remembered (window_keep's ``MAX_JUNCTIONS``).
MAX_JUNCTIONS = 1 << 16


@dataclass(frozen=True)
class StoreRule:
    """``kind``: ``dense``, ``vllm`` or ``windows``; ``junctions`` / ``every`` (chunks):
    what ``windows`` adds to vLLM's window."""

    kind: str = "vllm"
    junctions: bool = False
    every: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "vllm", "windows"):
            raise ValueError(f"unknown store rule {self.kind!r}")
        if self.every < 0:
            raise ValueError(f"every must be >= 0 chunks, got {self.every}")

    @property
    def label(self) -> str:
        if self.kind != "windows":
            return self.kind
        parts = (["junctions"] if self.junctions else []) + (
            [f"every {self.every}"] if self.every else []
        )
        return "windows(" + "+".join(parts) + ")"


#: Every windowed chunk (the replay's historical rule).
DENSE = StoreRule("dense")
#: vLLM 0.33's default: the window before the last prompt token only.
VLLM = StoreRule("vllm")


class Junctions:
    """Chunk ids (of the full-attention chain) after which prompts were seen to part (LRU)."""

    def __init__(self, capacity: int = MAX_JUNCTIONS) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._ids

    def add(self, chunk: int) -> None:
        if chunk in self._ids:
            self._ids.move_to_end(chunk)
            return
        self._ids[chunk] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


def windowed_store(
    rule: StoreRule,
    prompt: Sequence[int],
    hit: int,
    window: int,
    tokens_per_chunk: int,
    junctions: Junctions,
) -> list[int]:
    """Chunk indices in ``[hit, n)`` of a ``window``-chunk group that the store offers: the
    ``window``-chunk tail of each chunk boundary the rule keeps."""
    n = len(prompt)
    if rule.kind == "dense":
        return list(range(hit, n))
    last = (n * tokens_per_chunk - 1) // tokens_per_chunk  # vLLM's replay boundary
    found = {last}
    if rule.kind == "windows":
        hi = n + window  # window_keep looks that far: a boundary past the end can need blocks
        if rule.junctions and len(junctions):
            found.update(j + 1 for j in range(hit, n) if prompt[j] in junctions)
        if rule.every:
            b = (hit // rule.every + 1) * rule.every
            while b <= hi:
                found.add(b)
                b += rule.every
    keep = [False] * n
    for b in found:
        for c in range(max(hit, b - window), min(n, b)):
            keep[c] = True
    return [c for c in range(hit, n) if keep[c]]


def learn_junction(prompt: Sequence[int], full_prefix: int, junctions: Junctions) -> bool:
    """A lookup found ``full_prefix`` leading full-attention chunks of ``prompt`` stored and the
    next one missing: remember the last stored one (window_keep's rule). True if learnt."""
    if 0 < full_prefix < len(prompt):
        junctions.add(prompt[full_prefix - 1])
        return True
    return False


def store_keys(
    rule: StoreRule,
    keys: Sequence[Sequence[OffloadKey]],
    windows: Sequence[int | None],
    prompt: Sequence[int],
    hit: int,
    tokens_per_chunk: int,
    junctions: Junctions,
) -> list[OffloadKey]:
    """One request's store from ``hit`` on, group after group (vLLM's order): every chunk of a
    full group (window None), the kept chunks of a windowed one."""
    out: list[OffloadKey] = []
    for g, window in enumerate(windows):
        if window is None:
            out.extend(keys[g][hit:])
        else:
            chunks = windowed_store(rule, prompt, hit, window, tokens_per_chunk, junctions)
            out.extend(keys[g][c] for c in chunks)
    return out


# -- vLLM's per-group hit ------------------------------------------------------------------


class KeyLookups(Protocol):
    """What the hit needs of a tier: leading stored keys, and one key's presence."""

    def prefix(self, keys: Sequence[OffloadKey]) -> int: ...

    def has(self, key: OffloadKey) -> bool: ...


def _window_lookup(side: KeyLookups, keys: Sequence[OffloadKey], window: int) -> int:
    """End (in chunks) of the last run of ``window`` stored keys, scanning from the right."""
    run = 0
    for idx in range(len(keys) - 1, -1, -1):
        if side.has(keys[idx]):
            run += 1
            if run == window:
                return idx + window
        else:
            run = 0
    return run  # a run from the chain's head needs no full window


def hit_chunks(
    side: KeyLookups,
    keys: Sequence[Sequence[OffloadKey]],
    windows: Sequence[int | None],
    max_chunks: int,
    full_prefixes: list[int] | None = None,
) -> int:
    """vLLM's fixed point: full groups bound the hit, windowed groups (widest first) cut it.

    ``full_prefixes``, when given, receives each full group's prefix lookup (where the
    prompts part: window_keep learns its junctions from these)."""
    full = [g for g, w in enumerate(windows) if w is None]
    sized = [(w, g) for g, w in enumerate(windows) if w is not None]
    windowed = [(g, w) for w, g in sorted(sized, key=lambda x: -x[0])]
    m = max_chunks
    for g in full:
        if m <= 0:
            return 0
        found = side.prefix(keys[g][:m])
        if full_prefixes is not None:
            full_prefixes.append(found)
        m = min(m, found)
    while m > 0:
        cut = False
        for g, w in windowed:
            h = _window_lookup(side, keys[g][:m], w)
            if h == 0:
                return 0
            if h < m:
                m, cut = h, True
        if not cut:
            return m
    return 0
