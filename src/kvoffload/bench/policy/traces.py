"""Block-level traces in the Mooncake format: loading, and seeded generators.

A trace is a list of ``MooncakeRequest`` (``kvoffload.bench.policy.mooncake``): per
request the ids of its prompt blocks, equal ids meaning equal prefix blocks.
The generators build ids the way chained hashes behave: a block's id is a
function of its parent's id and its own content, so two prompts share ids
exactly as far as they share a prefix.

Workload kinds (``generate``): ``chat`` (multi-turn conversations with Zipf
popularity over a few system prompts), ``agent`` (loops that re-send a long
shared tool prompt plus a growing scratchpad), ``rag`` (a system prompt, one
of a Zipf-popular corpus of documents, a one-off question), ``oneoff`` (long
unique prompts behind a short shared head: a scan) and ``mixed`` (all four
interleaved), ``loop`` (a few prefixes sent again and again in turn:
a cyclic working set; replay it at ``LOOP_CAPACITY`` of its unique blocks and
it is twice the tier) and ``conversation`` (shaped after the Mooncake FAST'25
conversation trace: one shared system block, mostly one-turn sessions, and
sessions whose next turn comes minutes later, on the trace's 3 s clock, each
request ending in a partial block). The same kind, size and seed always give
the same trace.

Replays offer only a request's *full* blocks: a Mooncake request of
``input_length`` tokens has ``ceil(input_length / 512)`` ids, the last one
usually a partial block that an engine never hashes, stores or looks up, so
``trace_keys`` keeps the first ``input_length // block_size`` (``full_blocks``).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from kvoffload.bench.policy.mooncake import MooncakeRequest, full_blocks, read_mooncake_trace
from kvoffload.offload import OffloadKey, make_offload_key

KINDS = ("chat", "agent", "rag", "oneoff", "mixed", "loop", "conversation")
#: The capacity at which a ``loop`` trace's working set is twice the tier.
LOOP_CAPACITY = "50%"


def load_trace(path: str | Path) -> list[MooncakeRequest]:
    """The requests of a Mooncake JSONL file, in timestamp order (stable)."""
    return sorted(read_mooncake_trace(path), key=lambda r: r.timestamp)


def save_trace(requests: Sequence[MooncakeRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj = {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids,
            }
            f.write(json.dumps(obj) + "\n")


def trace_keys(
    requests: Sequence[MooncakeRequest], block_size: int = 512
) -> list[list[OffloadKey]]:
    """Each request's full blocks as offload keys (group 0); equal ids give equal keys."""
    cache: dict[int, OffloadKey] = {}

    def key(h: int) -> OffloadKey:
        k = cache.get(h)
        if k is None:
            k = cache[h] = make_offload_key(h.to_bytes(8, "big", signed=True))
        return k

    return [[key(h) for h in full_blocks(r, block_size)] for r in requests]


def trace_times(requests: Sequence[MooncakeRequest]) -> list[float]:
    """Each request's arrival, in the trace's milliseconds."""
    return [r.timestamp for r in requests]


class _Chains:
    """Chained block ids: ``extend(parent, contents)`` -> ids, shared by equal prefixes."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def extend(self, parent: int, contents: Sequence[object]) -> list[int]:
        out = []
        for c in contents:
            parent = self._ids.setdefault((parent, c), len(self._ids))
            out.append(parent)
        return out


def _zipf(rng: np.random.Generator, n: int, s: float) -> Callable[[], int]:
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(w / w.sum())
    perm = rng.permutation(n)
    return lambda: int(perm[min(int(np.searchsorted(cdf, rng.random())), n - 1)])


def _chat(rng: np.random.Generator, chains: _Chains, tag: str) -> Iterator[list[int]]:
    systems = [[(tag, "sys", s, i) for i in range(int(rng.integers(2, 8)))] for s in range(4)]
    pick_sys = _zipf(rng, len(systems), 1.2)
    slots = 200
    pick_slot = _zipf(rng, slots, 1.0)
    convs: dict[int, tuple[list[object], int]] = {}
    n = 0
    while True:
        slot = pick_slot()
        hist, left = convs.get(slot, ([], 0))
        if left == 0 or len(hist) > 120:
            hist, left = list(systems[pick_sys()]), int(rng.integers(2, 15))
        n += 1
        hist = hist + [(tag, "turn", n, i) for i in range(int(rng.integers(1, 4)))]
        yield chains.extend(-1, hist)
        hist = hist + [(tag, "reply", n, i) for i in range(int(rng.integers(0, 3)))]
        convs[slot] = (hist, left - 1)


def _agent(rng: np.random.Generator, chains: _Chains, tag: str) -> Iterator[list[int]]:
    tools = [[(tag, "tool", t, i) for i in range(int(rng.integers(20, 60)))] for t in range(6)]
    pick_tool = _zipf(rng, len(tools), 1.0)
    live: list[tuple[list[object], int]] = []
    n = 0
    while True:
        if len(live) < 8 or rng.random() < 0.05:
            live.append((list(tools[pick_tool()]), int(rng.integers(3, 25))))
        i = int(rng.integers(0, len(live)))
        ctx, left = live[i]
        n += 1
        ctx = ctx + [(tag, "step", n, j) for j in range(int(rng.integers(1, 4)))]
        yield chains.extend(-1, ctx)
        if left <= 1:
            live.pop(i)
        else:
            live[i] = (ctx, left - 1)


def _rag(rng: np.random.Generator, chains: _Chains, tag: str) -> Iterator[list[int]]:
    system = [(tag, "sys", i) for i in range(3)]
    docs = [[(tag, "doc", d, i) for i in range(int(rng.integers(4, 24)))] for d in range(2000)]
    pick_doc = _zipf(rng, len(docs), 0.9)
    n = 0
    while True:
        n += 1
        q = [(tag, "q", n, i) for i in range(int(rng.integers(1, 3)))]
        yield chains.extend(-1, [*system, *docs[pick_doc()], *q])


def _oneoff(rng: np.random.Generator, chains: _Chains, tag: str) -> Iterator[list[int]]:
    head = [(tag, "head", i) for i in range(2)]
    n = 0
    while True:
        n += 1
        body = [(tag, "body", n, i) for i in range(int(rng.integers(20, 200)))]
        yield chains.extend(-1, [*head, *body])


def _loop(rng: np.random.Generator, chains: _Chains, tag: str) -> Iterator[list[int]]:
    # Eight prompts of 20-60 blocks, always sent in the same turn: reuse
    # distance is the whole working set, which defeats recency.
    prompts = [
        chains.extend(-1, [(tag, "loop", p, i) for i in range(int(rng.integers(20, 61)))])
        for p in range(8)
    ]
    while True:
        yield from prompts


def _conversation(rng: np.random.Generator, num_requests: int) -> list[MooncakeRequest]:
    # Shape measured on the Mooncake FAST'25 conversation trace: ~3.4 requests/s
    # stamped on a 3 s clock, every prompt behind one shared system block, about a
    # third of requests continuing an earlier session whose last turn came 20 s to
    # 10 min before (median ~100 s); a turn adds a block or three, now and then a
    # pasted document; first prompts are long-tailed (1 to ~180 blocks).
    chains = _Chains()
    new_per_ms, multi_share, p_continue = 2.4e-3, 0.22, 0.65
    pending: list[tuple[float, int, list[object]]] = []  # (next turn at, seq, history)
    out: list[MooncakeRequest] = []
    t_new = float(rng.exponential(1 / new_per_ms))
    seq = 0
    while len(out) < num_requests:
        seq += 1
        if pending and pending[0][0] <= t_new:
            t, _, hist = heapq.heappop(pending)
            paste = rng.random() < 0.08
            grow = int(rng.lognormal(np.log(15), 1.0)) if paste else int(rng.geometric(0.55))
            hist = hist + [("turn", seq, i) for i in range(max(grow, 1))]
            go_on = rng.random() < p_continue and len(hist) < 250
        else:
            t = t_new
            t_new += float(rng.exponential(1 / new_per_ms))
            first = min(int(rng.lognormal(np.log(10), 1.2)), 180)
            hist = [("sys",)] + [("first", seq, i) for i in range(first)]
            go_on = rng.random() < multi_share
        ids = chains.extend(-1, hist)
        partial = int(rng.integers(1, 512))
        ids.append(chains.extend(ids[-1], [("partial", seq)])[0])
        stamp = 3000.0 * (t // 3000.0)
        tokens = 512 * len(hist) + partial
        out.append(MooncakeRequest(stamp, tokens, int(rng.integers(1, 900)), ids))
        if go_on:
            gap = float(np.clip(rng.lognormal(np.log(100e3), 0.9), 6e3, 1.2e6))
            heapq.heappush(pending, (t + gap, seq, hist))
    return out


_GENERATORS = {
    "chat": _chat,
    "agent": _agent,
    "rag": _rag,
    "oneoff": _oneoff,
    "loop": _loop,
}
_MIXED = ("chat", "agent", "rag", "oneoff")


def generate(kind: str, num_requests: int, seed: int = 0) -> list[MooncakeRequest]:
    """A seeded synthetic trace of ``kind`` (see the module docstring), 512-token blocks."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(KINDS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    rng = np.random.default_rng(seed)
    if kind == "conversation":
        return _conversation(rng, num_requests)
    chains = _Chains()
    names = list(_MIXED) if kind == "mixed" else [kind]
    streams = [_GENERATORS[k](rng, chains, k) for k in names]
    weights = np.array([0.35, 0.25, 0.3, 0.1] if kind == "mixed" else [1.0])
    out: list[MooncakeRequest] = []
    t = 0.0
    for _ in range(num_requests):
        s = streams[int(rng.choice(len(streams), p=weights))]
        ids = next(s)
        t += float(rng.exponential(100.0))
        out.append(MooncakeRequest(round(t, 3), 512 * len(ids), int(rng.integers(16, 512)), ids))
    return out
