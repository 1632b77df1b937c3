"""``kvoffload bench hybrid --windows``: extra sliding-window stores at equal CPU bytes.

Every row replays the same prompts through vLLM's per-group hit, load and
store (``hybrid_replay``) with the same number of slots; rows differ in the
tier's policy and in which windowed chunks a store offers
(``hybrid_windows``):

- ``kvoffload (default)``: kvoffload's default policy with its chunk-unit
  layer, and ``KVOffloadConnector``'s default stores: vLLM's window plus the
  windows at learnt junctions and one every ``every`` tokens
  (``window_keep.default_every``), which the chunk-unit layer holds only
  where a known boundary reaches them and evicts first otherwise;
- ``kvoffload (windows off)``: the same policy with vLLM's own store rule;
- ``vllm:lru`` / ``vllm:arc``: vLLM 0.33's managers with vLLM's store rule.

The hit rate is prompt tokens served from the CPU tier over prompt tokens.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

from kvoffload.bench.policy.hybrid_replay import (
    _cdiv,
    _side,
    _workloads,
    replay,
    vllm_unavailable,
)
from kvoffload.bench.policy.hybrid_windows import VLLM, StoreRule
from kvoffload.integrations.vllm.groups.window_keep import default_every
from kvoffload.offload.chunk_units import GroupLayout

DEFAULT = "kvoffload (default)"
OFF = "kvoffload (windows off)"
#: (label, policy row of ``hybrid_replay``, store rule or None for the default rule).
ROWS: tuple[tuple[str, str, StoreRule | None], ...] = (
    (DEFAULT, "kvoffload:default+units", None),
    (OFF, "kvoffload:default+units", VLLM),
    ("vllm:lru", "vllm:lru", VLLM),
    ("vllm:arc", "vllm:arc", VLLM),
)


def default_rule(layout: Sequence[GroupLayout]) -> StoreRule:
    """``KVOffloadConnector``'s default extra windows for ``layout`` (in the replay's chunks)."""
    t = layout[0].tokens_per_chunk
    windows = [g.sliding_window for g in layout if g.sliding_window is not None]
    if not windows:
        return VLLM
    every = default_every(max(windows), t)
    return StoreRule("windows", junctions=True, every=_cdiv(every, t) if every else 0)


def bench_windows(
    workloads: Sequence[tuple[str, tuple[GroupLayout, ...], list[list[int]]]],
    fractions: Sequence[float],
    rows: Sequence[tuple[str, str, StoreRule | None]],
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Every row on every workload at every capacity (a fraction of the distinct keys)."""
    points: list[dict[str, object]] = []
    for name, layout, prompts in workloads:
        unique = len({c for p in prompts for c in p}) * len(layout)
        rule = default_rule(layout)
        for frac in fractions:
            slots = max(1, round(frac * unique))
            hits: dict[str, float] = {}
            for label, row, row_rule in rows:
                if progress:
                    progress(f"{name} @ {frac:.0%}: {label}")
                side = _side(row, slots, layout)
                result = replay(side, row, prompts, layout, row_rule or rule)
                hits[label] = result.hit_rate
            best_vllm = max((h for k, h in hits.items() if k.startswith("vllm:")), default=None)
            points.append(
                {
                    "workload": name,
                    "capacity_fraction": frac,
                    "slots": slots,
                    "default_rule": rule.label,
                    "hit_rate": hits,
                    "default_vs_off": _ratio(hits.get(DEFAULT), hits.get(OFF)),
                    "default_vs_vllm_best": _ratio(hits.get(DEFAULT), best_vllm),
                }
            )
    return {"points": points}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(report: dict[str, object], labels: Sequence[str]) -> list[str]:
    head = f"{'workload':<20} {'cap':>4} {'slots':>7}  " + "  ".join(f"{x:>24}" for x in labels)
    lines = [head + f"  {'default/off':>11}  {'default/vLLM best':>17}  default rule"]
    for p in report["points"]:  # type: ignore[attr-defined]
        hits = p["hit_rate"]
        cells = "  ".join(f"{100 * hits[x]:>23.2f}%" if x in hits else f"{'-':>24}" for x in labels)
        off, best = p["default_vs_off"], p["default_vs_vllm_best"]
        lines.append(
            f"{p['workload']:<20} {p['capacity_fraction']:>4.0%} {p['slots']:>7}  {cells}  "
            + (f"{off:>10.3f}x" if off is not None else f"{'-':>11}")
            + "  "
            + (f"{best:>16.3f}x" if best is not None else f"{'-':>17}")
            + f"  {p['default_rule']}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    rows = list(ROWS)
    reason = None if args.no_vllm else vllm_unavailable()
    if args.no_vllm or reason:
        rows = [r for r in rows if not r[1].startswith("vllm:")]
    fractions = [float(x) for x in args.capacity.split(",") if x]
    work = _workloads(args)
    labels = [r[0] for r in rows]
    from kvoffload.bench.console import console as wide_console
    from kvoffload.bench.console import progress_bar

    total = len(work) * len(fractions) * len(rows)
    with progress_bar("replaying", total, show=not args.json) as advance:
        report = bench_windows(work, fractions, rows, advance)
    if args.json:
        report["vllm"] = reason or ("not requested" if args.no_vllm else "0.33 managers")
        print(json.dumps(report))
        return 0
    console = wide_console(200)
    if reason:
        console.print(f"vLLM rows skipped: {reason}")
    console.print(
        "prompt tokens served from the CPU tier / prompt tokens; equal CPU bytes (every row has "
        "the same slots); vLLM 0.33's per-group hit, load and store rule"
    )
    for line in table(report, labels):
        console.print(line, highlight=False)
    return 0
