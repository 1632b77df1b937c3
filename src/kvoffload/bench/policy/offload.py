"""``kvoffload bench offload``: CPU-tier cache policies replayed on a Mooncake trace.

Each request is replayed as a connector drives the tier, with nothing else in
the way (no GPU tier): ``lookup`` of its blocks (the leading stored ones are
its hits), ``prepare_load`` / ``complete_load`` of the hits, then ``admit``
of the rest (the tier's admission filter; declined keys are not offered, as
kvoffload's connector does), ``prepare_store`` of the admitted keys and
``complete_store`` of what the tier took,
and ``touch`` of those of the rest that were already stored. kvoffload's
policies run through ``CPUOffloadingManager``; vLLM's own ``lru`` and ``arc``
(and ``lru`` with ``store_threshold=2``, vLLM's admission filter) run through
vLLM's ``CPUOffloadingManager`` in the same process, driven the same way
(``kvoffload.bench.policy.vllm_replay``).

Only full blocks are replayed (``input_length // 512`` ids of a Mooncake
request; ``kvoffload.bench.policy.traces.trace_keys``). With a lookahead of D
seconds (``--lookahead-s``), before request i is served every request that
has arrived by ``t_i + D`` and was not announced yet is announced with
``hint_queued`` (the queue a server at that load holds), and each request is
``hint_dequeued`` once it is scheduled: after its lookup and load, before its
store. vLLM's rows get the same trace and no hints (vLLM's manager has none).

With ``--session-oracle`` one more row replays the default policy with session
hints taken from the trace's own future: after request i is served, its blocks
get ``hint_continues`` when a later request extends its whole prompt (a
conversation's next turn). No server knows that, so the row is an oracle, shown
beside the policy and never counted as its result.

Figures per policy and capacity: block hit rate (hit blocks over all blocks
of all requests) and block-ops/s (keys handed to manager calls per second;
the same count for every manager). Beside them: Belady's MIN (offline optimum
with bypass over the same block sequence; it counts any resident block as a
hit, so it bounds every policy's prefix hit rate) and the ceiling (an
infinite tier: every block but first uses hits).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvoffload.bench import plots
from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.bench.policy.traces import (
    KINDS,
    LOOP_CAPACITY,
    generate,
    load_trace,
    trace_keys,
    trace_times,
)
from kvoffload.cli import argtypes
from kvoffload.offload import CPUOffloadingManager, OffloadingManager, OffloadKey, policy_names
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.offload.policies import CachePolicy

Trace = Sequence[Sequence[OffloadKey]]
VLLM_ROWS = ("vllm:lru", "vllm:arc", "vllm:lru+store_threshold=2")
#: The row of ``--session-oracle``: the default policy told which sessions continue.
ORACLE_ROW = f"{DEFAULT_CACHE_POLICY}+session-oracle"


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


# argparse %-formats help strings.
_LOOP_CAPACITY_HELP = LOOP_CAPACITY.replace("%", "%%")


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
    queued, dequeued = _hint_calls(m)
    announced = 0
    n_req = len(trace)
    hits = ops = blocks = refused = 0
    start = time.perf_counter()
    for i, keys in enumerate(trace):
        if continues is not None and i and continues[i - 1] and trace[i - 1]:
            m.hint_continues(trace[i - 1])  # request i - 1 is served: its session goes on
        if hinted:
            horizon = times[i] + lookahead_ms  # type: ignore[index]
            while announced < n_req and times[announced] <= horizon:  # type: ignore[index]
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


def _steady_heap() -> None:
    """Start a timed replay from a collected heap, the objects alive now frozen.

    Otherwise the garbage and live objects of earlier replays (vLLM's block
    objects, a chain list's nodes) are traversed by full collections that fall
    inside a later replay: one row at one size measured 2.6x slower, and the
    ratio to vLLM lru swung 3.6x-4.8x between runs."""
    gc.collect()
    gc.freeze()


def _ratio(ops: float, base: float | None) -> float | None:
    return ops / base if base else None


def _admit_all(keys: Sequence[OffloadKey]) -> None:
    return None


def _hint_calls(
    m: CPUOffloadingManager,
) -> tuple[Callable[[str, Sequence[OffloadKey]], None], Callable[[str], None]]:
    """The manager's queue-hint methods (its policy's where the manager does not forward them)."""
    base = getattr(OffloadingManager, "hint_queued", None)
    if base is not None and getattr(type(m), "hint_queued", base) is not base:
        return m.hint_queued, m.hint_dequeued  # type: ignore[attr-defined]
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


def bench(
    trace: Trace,
    capacities: Sequence[str],
    policies: Sequence[str],
    with_vllm: bool = True,
    progress: Callable[[str], None] | None = None,
    times: Sequence[float] | None = None,
    lookahead_s: float = 0.0,
    session_oracle: bool = False,
) -> dict[str, object]:
    """Every policy at every capacity, Belady and the ceiling: one JSON-able dict.

    ``times`` (ms) and ``lookahead_s > 0``: kvoffload's managers get queue
    hints (see the module docstring); vLLM's rows never do. ``session_oracle``:
    one more row, ``ORACLE_ROW``, the default policy with session hints from the
    trace's future (not a policy's result: it is left out of the summary's best row).
    """
    if lookahead_s < 0:
        raise ValueError(f"lookahead must be >= 0 s, got {lookahead_s}")
    if lookahead_s > 0 and (times is None or len(times) != len(trace)):
        raise ValueError("a lookahead needs one arrival time per request")
    known = policy_names()
    for p in policies:
        if p not in known:
            raise ValueError(f"unknown cache policy {p!r}; known: {', '.join(known)}")
    blocks = sum(len(k) for k in trace)
    if not blocks:
        raise ValueError("the trace holds no blocks")
    unique = len({k for keys in trace for k in keys})
    caps = [(c, parse_capacity(c, unique)) for c in capacities]
    vllm_error = offload_vllm.unavailable() if with_vllm else "not requested (--no-vllm)"
    continuing = session_continues(trace) if session_oracle else None
    rows: list[dict[str, object]] = []
    summary: dict[str, dict[str, object]] = {}

    def timed_row(what: str) -> None:
        """Before each timed replay: say which, and start it from a steady heap."""
        if progress:
            progress(what)
        _steady_heap()

    try:
        for label, cap in caps:
            if progress:
                progress(f"Belady @ {label}")
            belady = belady_hit_rate(trace, cap)
            results = []
            for p in policies:
                timed_row(f"{p} @ {label}")
                results.append(replay(trace, p, cap, times, 1000.0 * lookahead_s))
            if continuing is not None:
                timed_row(f"{ORACLE_ROW} @ {label}")
                r = replay(
                    trace, DEFAULT_CACHE_POLICY, cap, times, 1000.0 * lookahead_s, True, continuing
                )
                r.policy = ORACLE_ROW
                results.append(r)
            for name in VLLM_ROWS if vllm_error is None else ():
                timed_row(f"{name} @ {label}")
                policy, threshold = offload_vllm.ROWS[name]
                hits, ops, seconds, refused = offload_vllm.replay(trace, policy, cap, threshold)
                results.append(ReplayResult(name, cap, blocks, hits, ops, seconds, refused))
            theirs = [r for r in results if r.policy.startswith("vllm:")]
            vllm_ops = {r.policy: r.ops_per_s for r in theirs}
            vllm_best = max((r.hit_rate for r in theirs), default=None)
            for r in results:
                row = asdict(r)
                row.update(
                    label=label,
                    hit_rate=r.hit_rate,
                    ops_per_s=r.ops_per_s,
                    ops_vs_vllm_lru=_ratio(r.ops_per_s, vllm_ops.get("vllm:lru")),
                    # Against vLLM's policy of the same name (arc vs vllm:arc), where it has one.
                    ops_vs_vllm_same=_ratio(r.ops_per_s, vllm_ops.get(f"vllm:{r.policy}")),
                    of_belady=(r.hit_rate / belady) if belady else None,
                )
                rows.append(row)
            ours = next((r for r in results if r.policy == DEFAULT_CACHE_POLICY), None)
            gap = None
            if ours is not None and vllm_best is not None and belady > vllm_best:
                gap = (ours.hit_rate - vllm_best) / (belady - vllm_best)
            real = [r for r in results if r.policy != ORACLE_ROW]
            summary[label] = {
                "capacity": cap,
                "belady_hit_rate": belady,
                "best_policy": max(real, key=lambda r: r.hit_rate).policy,
                "best_hit_rate": max(r.hit_rate for r in real),
                "vllm_best_hit_rate": vllm_best,
                "default_hit_rate": ours.hit_rate if ours else None,
                "default_gap_closed": gap,
            }
    finally:
        gc.unfreeze()  # (frozen objects would outlive the run)
    return {
        "requests": len(trace),
        "blocks": blocks,
        "full_blocks_only": True,
        "lookahead_s": lookahead_s,
        "session_oracle": session_oracle,
        "unique_blocks": unique,
        "ceiling_hit_rate": ceiling_hit_rate(trace),
        "default_policy": DEFAULT_CACHE_POLICY,
        "vllm": vllm_error or "available",
        "capacities": summary,
        "results": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvoffload.bench.policy import suite_report as offload_suite_report

    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--suite",
        action="store_true",
        help="replay the held-out suite instead: generated families (several seeds) and every "
        "real trace at hand, each policy's points against vLLM's best per trace and family, "
        "and a leave-one-family-out table (kvoffload.bench.policy.suite)",
    )
    src.add_argument(
        "--trace",
        type=argtypes.existing_file,
        help="Mooncake JSONL trace (hash_ids per request)",
    )
    src.add_argument(
        "--generate",
        choices=KINDS,
        default=None,
        help="replay a seeded synthetic trace of this kind instead (default: mixed; "
        f"loop: 8 prompts in turn, whose working set is twice the tier at {_LOOP_CAPACITY_HELP})",
    )
    parser.add_argument(
        "--requests",
        type=argtypes.positive_int(1_000_000),
        default=3000,
        help="requests of --generate",
    )
    parser.add_argument(
        "--seed", type=argtypes.any_int(2**63 - 1, 0), default=0, help="seed of --generate"
    )
    parser.add_argument(
        "--capacity",
        nargs="+",
        default=None,
        help="CPU tier sizes: block counts, or %% of the trace's unique blocks "
        f"(default: 1%% 5%% 10%% 25%%; for --generate loop {_LOOP_CAPACITY_HELP} too)",
    )
    parser.add_argument(
        "--lookahead-s",
        type=argtypes.finite_float(0.0, 86_400.0, allow_min=True),
        default=0.0,
        help="announce to kvoffload's policies, before each request, every request that "
        "arrives within this many seconds of it (a server's waiting queue: hint_queued, then "
        "hint_dequeued once scheduled); 0 (default): no hints. vLLM's rows never get hints",
    )
    parser.add_argument(
        "--session-oracle",
        action="store_true",
        help="add a row: the default policy with session hints from the trace's future "
        "(hint_continues for each request that a later request extends; an oracle, "
        "not the policy's result)",
    )
    parser.add_argument(
        "--policies",
        default="all",
        help=f"comma-separated, or all ({', '.join(policy_names())}); --suite also takes a "
        "building block's class name (e.g. SievePolicy; kvoffload.offload.policies)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's own policies")
    parser.add_argument(
        "--out", type=argtypes.output_dir, default=None, help="write table.md and plot.png here"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    offload_suite_report.add_arguments(parser)


def _trace_from_args(args: argparse.Namespace) -> tuple[str, Trace, list[float]]:
    """(name, full-block keys per request, arrival times in ms)."""
    if args.trace is not None:
        reqs = load_trace(args.trace)
        name = str(args.trace)
    else:
        kind = args.generate or "mixed"
        reqs = generate(kind, args.requests, args.seed)
        name = f"generated {kind} (seed {args.seed})"
    return name, trace_keys(reqs), trace_times(reqs)


def _capacities(args: argparse.Namespace) -> list[str]:
    if args.capacity is not None:
        return list(args.capacity)
    caps = ["1%", "5%", "10%", "25%"]
    return [*caps, LOOP_CAPACITY] if args.generate == "loop" else caps


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.policy import offload_report

    if args.suite:
        from kvoffload.bench.policy import suite_report as offload_suite_report

        return offload_suite_report.run(args)
    policies = (
        policy_names()
        if args.policies == "all"
        else [p.strip() for p in args.policies.split(",") if p.strip()]
    )
    if not policies:
        raise ValueError("--policies is empty")
    if args.out:
        plots.require("kvoffload bench offload --out")
    name, trace, times = _trace_from_args(args)
    caps = _capacities(args)
    look = args.lookahead_s
    oracle = args.session_oracle
    if args.json:
        report = bench(trace, caps, policies, not args.no_vllm, None, times, look, oracle)
        report["trace"] = name
        if args.out:
            offload_report.write(report, args.out)
        print(json.dumps(report))
        return 0

    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped to a file or CI log: no terminal to fit
    per_cap = len(policies) + 1 + oracle + (0 if args.no_vllm else len(VLLM_ROWS))
    steps = len(caps) * per_cap
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=steps)

        def progress(what: str) -> None:
            bar.update(task, advance=1, description=what)

        report = bench(trace, caps, policies, not args.no_vllm, progress, times, look, oracle)
    report["trace"] = name
    offload_report.print_report(report, console)
    if args.out:
        paths = offload_report.write(report, args.out)
        console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0
