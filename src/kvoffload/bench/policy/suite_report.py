"""The report and command line of ``kvoffload bench offload --suite`` (``offload_suite``)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from rich.table import Table

from kvoffload.bench.policy import suite, suite_hybrid
from kvoffload.bench.policy import suite_cache as offload_suite_cache
from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.offload import policy_names


def _d(x: float) -> str:
    return f"{x:+.2f}"


def trace_table(points: Sequence[suite.Point], candidates: Sequence[str]) -> Table:
    """Per trace and size: vLLM's best and Belady (hit %), each candidate's delta (points)."""
    t = Table(title="hit % of vLLM's best, and each policy's points above (+) or below (-) it")
    t.add_column("trace @ size")
    t.add_column("vLLM best", justify="right")
    t.add_column("Belady", justify="right")
    for c in candidates:
        t.add_column(c, justify="right")
    for pt in points:
        best_row = max(pt.vllm, key=pt.vllm.__getitem__).removeprefix("vllm:")
        t.add_row(
            f"{pt.trace} @ {pt.label}",
            f"{100 * pt.vllm_best:.2f} ({best_row})",
            "-" if math.isnan(pt.belady) else f"{100 * pt.belady:.2f}",
            *(_d(pt.delta(c)) for c in candidates),
        )
    return t


def family_table(points: Sequence[suite.Point], candidates: Sequence[str]) -> Table:
    """Per family: each candidate's worst delta to vLLM's best (its worst loss)."""
    t = Table(title="worst points against vLLM's best, per family")
    t.add_column("family")
    for c in candidates:
        t.add_column(c, justify="right")
    for fam, worst in suite.worst_by_family(points, candidates).items():
        t.add_row(fam, *(_d(worst[c]) for c in candidates))
    return t


def held_out_table(points: Sequence[suite.Point], candidates: Sequence[str]) -> Table:
    """Leave one family out: the candidate chosen without it, judged on it."""
    t = Table(title="leave one family out: chosen on the others, judged on the one left out")
    for col in (
        "left out",
        "chosen",
        "worst there",
        "worst where chosen",
        "default there",
        "best there",
    ):
        t.add_column(col, justify="left" if col in ("left out", "chosen") else "right")
    for h in suite.leave_one_family_out(points, candidates):
        t.add_row(
            h.family,
            h.chosen,
            _d(h.held_out_worst),
            _d(h.in_sample_worst),
            _d(h.default_worst),
            _d(h.best_worst),
        )
    return t


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own options (``--suite`` itself is ``bench offload``'s)."""
    parser.add_argument(
        "--suite-size",
        choices=tuple(suite.SIZES),
        default="quick",
        help="--suite: quick (default; "
        f"{suite.SIZES['quick'].requests:,} requests x {len(suite.SIZES['quick'].seeds)} seeds "
        "per generated family, a few minutes on 2 cores) or full "
        f"({suite.SIZES['full'].requests:,} x {len(suite.SIZES['full'].seeds)})",
    )
    parser.add_argument(
        "--trace-file",
        action="append",
        default=None,
        metavar="PATH",
        help="--suite: a real Mooncake JSONL trace, a family of its own (repeatable; default: "
        f"{suite.SHARED_TRACE} from ${suite.TRACE_DIR_ENV} or ../shared/traces, where found)",
    )
    parser.add_argument(
        "--no-vllm-cache",
        action="store_true",
        help="--suite: replay vLLM's rows again instead of reading them from the cache file "
        f"(${offload_suite_cache.CACHE_ENV}, else ~/.cache/kvoffload/suite_vllm_rows.json; "
        "keyed by trace, size, row and vLLM version)",
    )
    parser.add_argument(
        "--no-hybrid",
        action="store_true",
        help="--suite: leave out the hybrid family (KV cache groups with chunk units: "
        "kvoffload bench hybrid's layouts at 5 / 10 / 20%%; kvoffload.bench.policy.suite_hybrid)",
    )
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="CLASS.ATTR=V1,V2",
        help="--suite: also replay the default with a policy class's parameter at each value "
        "(e.g. ArmsDuel.fresh_share=0,0.05); the held-out table chooses among them",
    )


def run(args: argparse.Namespace) -> int:
    policies = (
        policy_names()
        if args.policies == "all"
        else [p.strip() for p in args.policies.split(",") if p.strip()]
    )
    variants = [v for spec in args.vary for v in suite.parse_variant(spec)]
    files = args.trace_file if args.trace_file else suite.default_trace_files()
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"--trace-file {f}: no such file")
    traces = suite.suite_traces(args.suite_size, files)
    candidates = [*policies, *(v.name for v in variants)]
    look = args.lookahead_s
    why = offload_vllm.unavailable()
    if why is not None:
        raise RuntimeError(f"the suite judges against vLLM's own policies: {why}")
    cache = None
    if not args.no_vllm_cache:
        cache = offload_suite_cache.VllmRowCache(
            offload_suite_cache.default_path(), suite.vllm_hit_rates
        )
    rows = cache.rows if cache is not None else suite.vllm_hit_rates
    hybrid = not args.no_hybrid
    if args.json:
        points = suite.run_suite(traces, policies, variants, look, None, rows)
        if hybrid:
            points += suite_hybrid.run_hybrid(policies, variants, args.suite_size)
        warning = _save(cache)
        report = suite.report_json(points, candidates, look, args.suite_size)
        for pt in cast(list[dict[str, object]], report["points"]):
            belady = pt["belady_hit_rate"]
            if isinstance(belady, float) and math.isnan(belady):
                pt["belady_hit_rate"] = None  # the hybrid family has none (JSON has no NaN)
        report["trace_files"] = [str(f) for f in files]
        report["vllm_rows_cached"] = cache.hits if cache is not None else 0
        if warning:
            report["warning"] = warning
        print(json.dumps(report))
        return 0
    from kvoffload.bench.console import console as wide_console
    from kvoffload.bench.console import progress_bar

    console = wide_console(160)
    total = suite.steps(traces, len(candidates))
    if hybrid:
        total += suite_hybrid.steps(args.suite_size, len(candidates))
    with progress_bar("suite", total) as progress:
        points = suite.run_suite(traces, policies, variants, look, progress, rows)
        if hybrid:
            points += suite_hybrid.run_hybrid(policies, variants, args.suite_size, progress)
    warning = _save(cache)
    if warning:
        console.print(warning)
    cached = (
        f"; vLLM's rows cached at {cache.hits} of {cache.hits + cache.misses} points"
        if cache
        else ""
    )
    console.print(
        f"suite {args.suite_size}, lookahead {look:g} s; real traces: "
        + (", ".join(str(f) for f in files) or "none found")
        + cached
    )
    console.print(trace_table(points, candidates))
    console.print(family_table(points, candidates))
    console.print(held_out_table(points, candidates))
    return 0


def _save(cache: offload_suite_cache.VllmRowCache | None) -> str | None:
    """Write the cache; a failure is one line of warning (it costs only the next run's time)."""
    if cache is None:
        return None
    try:
        cache.save()
    except OSError as exc:
        return f"warning: vLLM rows not cached ({cache.path}: {exc.strerror or exc})"
    return None
