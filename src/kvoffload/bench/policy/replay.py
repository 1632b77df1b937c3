"""Replaying a block trace through a CPU tier, as a connector drives it (no GPU tier).

Each request: ``lookup`` of its blocks (the leading stored ones are its hits),
``prepare_load`` / ``complete_load`` of the hits, then ``admit`` of the rest
(the tier's admission filter; declined keys are not offered, as kvoffload's
connector does), ``prepare_store`` of the admitted keys and ``complete_store``
of what the tier took, and ``touch`` of those of the rest that were already
stored.

Only full blocks are replayed (``input_length // 512`` ids of a Mooncake
request; ``kvoffload.bench.policy.traces.trace_keys``). With a lookahead of D
seconds, before request i is served every request that has arrived by
``t_i + D`` and was not announced yet is announced with ``hint_queued`` (the
queue a server at that load holds), and each request is ``hint_dequeued`` once
it is scheduled: after its lookup and load, before its store. With session
hints (an oracle: the trace's own future), after request i is served its blocks
get ``hint_continues`` when a later request extends its whole prompt.

Beside the replay: Belady's MIN (offline optimum with bypass over the same
block sequence; it counts any resident block as a hit, so it bounds every
policy's prefix hit rate) and the ceiling (an infinite tier: every block but
first uses hits).
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.offload import CPUOffloadingManager, OffloadingManager, OffloadKey
from kvoffload.offload.policies import CachePolicy

Trace = Sequence[Sequence[OffloadKey]]


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    blocks: int
    hit_blocks: int
    block_ops: int
    seconds: float
    stores_refused: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.block_ops / self.seconds if self.seconds > 0 else 0.0


def replay(
    trace: Trace,
    policy: str | type[CachePolicy],
    capacity: int,
    times: Sequence[float] | None = None,
    lookahead_ms: float = 0.0,
    admission: bool = True,
    continues: Sequence[bool] | None = None,
) -> ReplayResult:
    """Drive a fresh kvoffload manager through ``trace``; see the module docstring.

    ``admission``: ask the manager which new keys to store (``admit``) and offer
    only those, as kvoffload's connector does; False offers every key.

    ``times`` (ms, non-decreasing) with ``lookahead_ms > 0`` sends queue hints;
    ``continues`` (one flag per request) sends a request's keys as a session hint
    once it is served. Hint keys are not counted as block ops (their time is).
    """
    m = CPUOffloadingManager(capacity, cache_policy=policy)
    lookup, prepare_load, complete_load = m.lookup, m.prepare_load, m.complete_load
    prepare_store, complete_store, touch = m.prepare_store, m.complete_store, m.touch
    admit = m.admit if admission else _admit_all
    hinted = times is not None and lookahead_ms > 0
    arrivals: Sequence[float] = times if times is not None else ()
    queued, dequeued = _hint_calls(m)
    announced = 0
    n_req = len(trace)
    hits = ops = blocks = refused = 0
    start = time.perf_counter()
    for i, keys in enumerate(trace):
        if continues is not None and i and continues[i - 1] and trace[i - 1]:
            m.hint_continues(trace[i - 1])  # request i - 1 is served: its session goes on
        if hinted:
            horizon = arrivals[i] + lookahead_ms
            while announced < n_req and arrivals[announced] <= horizon:
                if trace[announced]:
                    queued(str(announced), trace[announced])
                announced += 1
        n = len(keys)
        blocks += n
        if not n:
            continue
        hit = lookup(keys)
        ops += min(hit + 1, n)
        if hit:
            loaded = keys[:hit]
            prepare_load(loaded)
            complete_load(loaded)
            hits += hit
            ops += 2 * hit
        if hinted:
            dequeued(str(i))
        rest = keys[hit:]
        if not rest:
            continue
        # The offered keys count once, admitted or not, as vLLM's rows count the keys
        # they hand to prepare_store: declining keys ahead must not shrink the count.
        ops += len(rest)
        flags = admit(rest)
        if flags is not None:
            rest = [k for k, f in zip(rest, flags) if f]
            if not rest:
                continue
        out = prepare_store(rest)
        if out is None:
            refused += len(rest)
            continue
        stored = out.keys_to_store
        if len(stored) < len(rest):
            touch(rest)
            ops += len(rest)
        if stored:
            complete_store(stored)
            ops += len(stored)
    seconds = time.perf_counter() - start
    name = policy if isinstance(policy, str) else policy.__name__
    return ReplayResult(name, capacity, blocks, hits, ops, seconds, refused)


def steady_heap() -> None:
    """Start a timed replay from a collected heap, the objects alive now frozen.

    Otherwise the garbage and live objects of earlier replays (vLLM's block
    objects, a chain list's nodes) are traversed by full collections that fall
    inside a later replay: one row at one size measured 2.6x slower, and the
    ratio to vLLM lru swung 3.6x-4.8x between runs."""
    gc.collect()
    gc.freeze()


def _admit_all(keys: Sequence[OffloadKey]) -> None:
    return None


def _hint_calls(
    m: CPUOffloadingManager,
) -> tuple[Callable[[str, Sequence[OffloadKey]], None], Callable[[str], None]]:
    """The manager's queue-hint methods (its policy's where the manager does not forward them)."""
    if type(m).hint_queued is not OffloadingManager.hint_queued:
        return m.hint_queued, m.hint_dequeued
    return m.policy.hint_queued, m.policy.hint_dequeued


def session_continues(trace: Trace) -> list[bool]:
    """Per request: does a later request extend its whole prompt (its last full block)?

    Block ids are chained, so a later request that holds a request's last block holds
    all of it: that later request is the conversation's next turn (or another reader of
    the same prefix). The trace's future decides: an oracle, for the replay only. O(blocks).
    """
    later: set[OffloadKey] = set()
    out = [False] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        keys = trace[i]
        if keys:
            out[i] = keys[-1] in later
            later.update(keys)
    return out


def ceiling_hit_rate(trace: Trace) -> float:
    """An infinite tier's hit rate: every block hits but its first use."""
    seen: set[OffloadKey] = set()
    total = 0
    for keys in trace:
        total += len(keys)
        seen.update(keys)
    return 1 - len(seen) / total if total else 0.0


def belady_hit_rate(trace: Trace, capacity: int) -> float:
    """Hit rate of MIN with bypass over the trace's block accesses; O(n log n).

    A miss is admitted only if its next use comes before that of the resident
    block used farthest in the future (which is then evicted); a block never
    used again is not kept. Stale heap entries are skipped lazily.
    """
    ids: dict[OffloadKey, int] = {}
    seq = [ids.setdefault(k, len(ids)) for keys in trace for k in keys]
    never = len(seq)
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for t in range(len(seq) - 1, -1, -1):
        k = seq[t]
        next_use[t] = last.get(k, never)
        last[k] = t
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key)
    hits = 0
    for t, k in enumerate(seq):
        nu = next_use[t]
        if k in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                neg, v = heap[0]
                if resident.get(v) == -neg:
                    break
                heapq.heappop(heap)
            if -neg <= nu:
                continue  # bypass: the newcomer is needed last
            heapq.heappop(heap)
            del resident[v]
        if nu == never:
            resident.pop(k, None)
            continue
        resident[k] = nu
        heapq.heappush(heap, (-nu, k))
    return hits / len(seq) if seq else 0.0


def parse_capacity(text: str, unique_blocks: int) -> int:
    """``"5%"`` of the trace's unique blocks (at least 1), or a block count."""
    t = text.strip()
    try:
        if t.endswith("%"):
            pct = float(t[:-1])
            if not pct > 0:
                raise ValueError
            return max(1, round(unique_blocks * pct / 100))
        n = int(t)
    except ValueError:
        raise ValueError(f"capacity {text!r} is neither a block count nor a percentage") from None
    if n < 1:
        raise ValueError(f"capacity must be positive, got {n}")
    return n
