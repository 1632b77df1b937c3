"""``kvoffload bench offload``: CPU-tier cache policies replayed on a Mooncake trace.

Each request is replayed as a connector drives the tier, with nothing else in
the way (``kvoffload.bench.policy.replay``: lookup, load, admit, store, touch;
only full blocks; with ``--lookahead-s`` queue hints, with ``--session-oracle``
session hints from the trace's future). kvoffload's policies run through
``CPUOffloadingManager``; vLLM's own ``lru`` and ``arc`` (and ``lru`` with
``store_threshold=2``, vLLM's admission filter) run through vLLM's
``CPUOffloadingManager`` in the same process, driven the same way
(``kvoffload.bench.policy.vllm_replay``); vLLM's rows get no hints (vLLM's
manager has none). The ``--session-oracle`` row is an oracle, shown beside the
policy and never counted as its result.

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
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict

from kvoffload.bench import plots
from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.bench.policy.replay import (
    ReplayResult,
    Trace,
    belady_hit_rate,
    ceiling_hit_rate,
    parse_capacity,
    replay,
    session_continues,
    steady_heap,
)
from kvoffload.bench.policy.traces import (
    KINDS,
    LOOP_CAPACITY,
    generate,
    load_trace,
    trace_keys,
    trace_times,
)
from kvoffload.cli import argtypes
from kvoffload.offload import policy_names
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY

VLLM_ROWS = ("vllm:lru", "vllm:arc", "vllm:lru+store_threshold=2")
#: The row of ``--session-oracle``: the default policy told which sessions continue.
ORACLE_ROW = f"{DEFAULT_CACHE_POLICY}+session-oracle"

# argparse %-formats help strings.
_LOOP_CAPACITY_HELP = LOOP_CAPACITY.replace("%", "%%")


def _ratio(ops: float, base: float | None) -> float | None:
    return ops / base if base else None


def _check(
    trace: Trace, policies: Sequence[str], times: Sequence[float] | None, lookahead_s: float
) -> int:
    """The trace's block count, after refusing what cannot be replayed."""
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
    return blocks


def _replays(
    trace: Trace,
    label: str,
    cap: int,
    policies: Sequence[str],
    vllm_rows: Sequence[str],
    timed_row: Callable[[str], None],
    times: Sequence[float] | None,
    lookahead_ms: float,
    continuing: Sequence[bool] | None,
) -> list[ReplayResult]:
    """Every row at one capacity: kvoffload's policies, the oracle, then vLLM's managers."""
    results = []
    for p in policies:
        timed_row(f"{p} @ {label}")
        results.append(replay(trace, p, cap, times, lookahead_ms))
    if continuing is not None:
        timed_row(f"{ORACLE_ROW} @ {label}")
        r = replay(trace, DEFAULT_CACHE_POLICY, cap, times, lookahead_ms, True, continuing)
        r.policy = ORACLE_ROW
        results.append(r)
    blocks = sum(len(k) for k in trace)
    for name in vllm_rows:
        timed_row(f"{name} @ {label}")
        policy, threshold = offload_vllm.ROWS[name]
        hits, ops, seconds, refused = offload_vllm.replay(trace, policy, cap, threshold)
        results.append(ReplayResult(name, cap, blocks, hits, ops, seconds, refused))
    return results


def _report_rows(
    results: Sequence[ReplayResult], label: str, cap: int, belady: float
) -> tuple[list[dict[str, object]], dict[str, object]]:
    """One capacity's result rows (with ratios) and its summary."""
    theirs = [r for r in results if r.policy.startswith("vllm:")]
    vllm_ops = {r.policy: r.ops_per_s for r in theirs}
    vllm_best = max((r.hit_rate for r in theirs), default=None)
    rows = []
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
    summary = {
        "capacity": cap,
        "belady_hit_rate": belady,
        "best_policy": max(real, key=lambda r: r.hit_rate).policy,
        "best_hit_rate": max(r.hit_rate for r in real),
        "vllm_best_hit_rate": vllm_best,
        "default_hit_rate": ours.hit_rate if ours else None,
        "default_gap_closed": gap,
    }
    return rows, summary


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
    blocks = _check(trace, policies, times, lookahead_s)
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
        steady_heap()

    try:
        for label, cap in caps:
            if progress:
                progress(f"Belady @ {label}")
            belady = belady_hit_rate(trace, cap)
            vllm_rows = VLLM_ROWS if vllm_error is None else ()
            results = _replays(
                trace, label, cap, policies, vllm_rows, timed_row, times,
                1000.0 * lookahead_s, continuing,
            )  # fmt: skip
            cap_rows, summary[label] = _report_rows(results, label, cap, belady)
            rows += cap_rows
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
        "building block's class name (e.g. AdmitLRUPolicy; kvoffload.offload.policies)",
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
    from kvoffload.bench.console import console, progress_bar

    oracle = args.session_oracle
    per_cap = len(policies) + 1 + oracle + (0 if args.no_vllm else len(VLLM_ROWS))
    with progress_bar("replaying", len(caps) * per_cap, show=not args.json) as advance:
        report = bench(
            trace, caps, policies, not args.no_vllm, advance, times, args.lookahead_s, oracle
        )
    report["trace"] = name
    if args.json:
        if args.out:
            offload_report.write(report, args.out)
        print(json.dumps(report))
        return 0
    out = console(120)
    offload_report.print_report(report, out)
    if args.out:
        paths = offload_report.write(report, args.out)
        out.print("wrote " + ", ".join(str(p) for p in paths))
    return 0
