"""Tables and the plot of the routing bench (one row per workload x instances x router)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvoffload.bench import plots
from kvoffload.bench.routing.routed_run import RunResult

BASELINE = "round_robin"


def vs_baseline(results: Sequence[RunResult]) -> dict[tuple[str, int, str], float]:
    """Prefill tokens computed as a ratio of round robin's in the same workload and size."""
    base = {
        (r.workload, r.instances): r.prefill_tokens_computed
        for r in results
        if r.router == BASELINE
    }
    out = {}
    for r in results:
        b = base.get((r.workload, r.instances))
        if b:
            out[(r.workload, r.instances, r.router)] = r.prefill_tokens_computed / b
    return out


def print_table(results: Sequence[RunResult], title: str) -> None:
    from rich.console import JustifyMethod
    from rich.table import Table

    from kvoffload.bench.console import console

    ratio = vs_baseline(results)
    table = Table(title=title)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("workload", "left"),
        ("N", "right"),
        ("router", "left"),
        ("hit GPU", "right"),
        ("hit CPU", "right"),
        ("hit Redis", "right"),
        ("prefill computed", "right"),
        ("x round robin", "right"),
        ("TTFT p50 (ms)", "right"),
        ("TTFT p99 (ms)", "right"),
        ("to longest prefix", "right"),
        ("per instance", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for r in results:
        x = ratio.get((r.workload, r.instances, r.router))
        table.add_row(
            r.workload,
            str(r.instances),
            r.router,
            f"{r.hit_rate_gpu:.1%}",
            f"{r.hit_rate_cpu:.1%}",
            f"{r.hit_rate_redis:.1%}",
            f"{r.prefill_tokens_computed:,}",
            "-" if x is None else f"{x:.2f}",
            f"{r.ttft_p50_s * 1e3:.0f}",
            f"{r.ttft_p99_s * 1e3:.0f}",
            f"{r.sent_to_longest_prefix:.0%}",
            "/".join(map(str, r.requests_per_instance)),
        )
    console(170).print(table)


def plot(results: Sequence[RunResult], path: str | Path) -> Path:
    """Bars per (workload, N): prefill tokens computed and TTFT p50, one bar per router."""
    plt = plots.pyplot("kvoffload bench route")

    groups = sorted({(r.workload, r.instances) for r in results})
    routers = list(dict.fromkeys(r.router for r in results))
    by = {(r.workload, r.instances, r.router): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(routers))
    for k, router in enumerate(routers):
        xs = [g + k * width for g in range(len(groups))]
        rows = [by.get((w, n, router)) for w, n in groups]
        axes[0].bar(xs, [r.prefill_tokens_computed if r else 0 for r in rows], width, label=router)
        axes[1].bar(xs, [r.ttft_p50_s * 1e3 if r else 0 for r in rows], width, label=router)
    labels = [f"{w}\nN={n}" for w, n in groups]
    centre = [g + 0.4 - width / 2 for g in range(len(groups))]
    for ax, title in zip(axes, ("prefill tokens computed", "TTFT p50 (ms)")):
        ax.set_xticks(centre, labels)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(
        "kvoffload bench route: KV-aware routing (Dynamo's indexer) vs round robin, random"
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
