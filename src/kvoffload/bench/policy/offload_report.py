"""The report of ``kvoffload bench offload``: terminal table, markdown table, plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvoffload.bench import plots
from kvoffload.bench.console import markdown_table


def _rows(report: dict[str, Any]) -> tuple[list[str], list[str], dict[str, dict[str, Any]]]:
    """(capacity labels, row names in first-seen order, name -> label -> row)."""
    labels = list(report["capacities"])
    names: list[str] = []
    by: dict[str, dict[str, Any]] = {}
    for row in report["results"]:
        if row["policy"] not in by:
            names.append(row["policy"])
            by[row["policy"]] = {}
        by[row["policy"]][row["label"]] = row
    return labels, names, by


def table_lines(report: dict[str, Any]) -> list[list[str]]:
    """Header + one line per row: hit rates per capacity, mean ops/s, lowest ratios to vLLM."""
    labels, names, by = _rows(report)
    caps = report["capacities"]
    head = ["policy"] + [f"{lb} ({caps[lb]['capacity']:,})" for lb in labels]
    head += ["Mops/s", "x vLLM lru", "x vLLM same"]
    lines = [head]
    default = report["default_policy"]
    for name in names:
        cells = [name + (" (default)" if name == default else "")]
        ops, ratios, same = [], [], []
        for lb in labels:
            row = by[name].get(lb)
            cells.append(f"{100 * row['hit_rate']:.2f}" if row else "-")
            if row:
                ops.append(row["ops_per_s"])
                if row["ops_vs_vllm_lru"] is not None:
                    ratios.append(row["ops_vs_vllm_lru"])
                if row.get("ops_vs_vllm_same") is not None:
                    same.append(row["ops_vs_vllm_same"])
        cells.append(f"{sum(ops) / len(ops) / 1e6:.2f}" if ops else "-")
        # The lowest size's ratios, not the means: a target holds at every size or not at all.
        cells.append(f"{min(ratios):.1f}x" if ratios else "-")
        cells.append(f"{min(same):.1f}x" if same and not name.startswith("vllm:") else "-")
        lines.append(cells)
    lines.append(
        ["Belady MIN"]
        + [f"{100 * caps[lb]['belady_hit_rate']:.2f}" for lb in labels]
        + ["", "", ""]
    )
    lines.append(
        ["ceiling"] + [f"{100 * report['ceiling_hit_rate']:.2f}"] * len(labels) + ["", "", ""]
    )
    return lines


def closing_note(report: dict[str, Any]) -> str:
    caps = report["capacities"]
    default = report["default_policy"]
    parts = []
    gaps = []
    for lb, s in caps.items():
        if s["default_gap_closed"] is None:
            continue
        parts.append(f"{lb}: {100 * s['default_gap_closed']:+.1f}%")
        if lb in ("1%", "5%", "10%"):
            gaps.append(s["default_gap_closed"])
    best = [  # ties count: the default is a best row where nothing beats it
        lb
        for lb, s in caps.items()
        if s["default_hit_rate"] is not None and s["default_hit_rate"] >= s["best_hit_rate"]
    ]
    text = (
        f"Default {default} is the best row at {len(best)} of {len(caps)} capacities"
        + (f" ({', '.join(best)})" if best else "")
        + "."
    )
    below = [
        lb
        for lb, s in caps.items()
        if s["vllm_best_hit_rate"] is not None
        and s["default_hit_rate"] is not None
        and s["default_hit_rate"] < s["vllm_best_hit_rate"]
    ]
    look = report.get("lookahead_s") or 0.0
    if parts:
        text += (
            f" Share of the gap from vLLM's best (lru, arc, lru+store_threshold=2) to Belady "
            f"that it closes{f' with a {look:g} s queue' if look else ''}: {'; '.join(parts)}"
        )
        if len(gaps) == 3:
            text += f" (mean over 1/5/10%: {100 * sum(gaps) / 3:+.1f}%)"
        text += "."
        text += (
            f" Below vLLM's best at: {', '.join(below)}." if below else " Never below vLLM's best."
        )
    else:
        text += f" vLLM: {report['vllm']}."
    return text


def replay_note(report: dict[str, Any]) -> str:
    """What was replayed: full blocks only, and the queue hints (if any)."""
    look = report.get("lookahead_s") or 0.0
    text = (
        "Full blocks only: input_length // 512 ids of each request (a trace's partial last "
        "block is never hashed by an engine). "
    )
    if look > 0:
        text += (
            f"Queue hints: before each request, every request arriving within {look:g} s is "
            "announced to kvoffload's policies (hint_queued), and dequeued once scheduled; "
            "vLLM's rows get no hints."
        )
    else:
        text += "No queue hints (--lookahead-s 0)."
    if report.get("session_oracle"):
        text += (
            f" {report['default_policy']}+session-oracle: the default policy told, after each "
            "request, whether a later request extends its prompt (hint_continues): an oracle "
            "from the trace's future, not the policy's result."
        )
    return text


def print_report(report: dict[str, Any], console: Console) -> None:
    lines = table_lines(report)
    table = Table(
        title=(
            f"{report['trace']}: {report['requests']:,} requests, {report['blocks']:,} blocks "
            f"({report['unique_blocks']:,} unique); block hit rate % by CPU tier size"
        )
    )
    # A policy's name never folds (the columns of figures narrow first, their headers
    # folding rather than cut): at 80 columns "chain_…" stood for three different rows.
    table.add_column(lines[0][0], justify="left", no_wrap=True)
    for col in lines[0][1:]:
        table.add_column(col, justify="right", overflow="fold")
    for cells in lines[1:]:
        table.add_row(*cells)
    console.print(table)
    console.print(replay_note(report))
    console.print(
        "Mops/s: million block operations per second through the manager (mean over sizes, "
        "noisy on a shared machine); x vLLM lru and x vLLM same: the lowest over sizes of "
        "the ratio to vLLM lru's, and to vLLM's policy of the same name (lru, arc), in the "
        "same run."
    )
    console.print(closing_note(report))


def markdown(report: dict[str, Any]) -> str:
    lines = table_lines(report)
    out = [
        f"# kvoffload bench offload: {report['trace']}",
        "",
        f"{report['requests']:,} requests, {report['blocks']:,} blocks, "
        f"{report['unique_blocks']:,} unique. Block hit rate (%) by CPU tier size "
        "(% of unique blocks, and blocks).",
        "",
        replay_note(report),
        "",
        *markdown_table(lines[0], lines[1:]),
        "",
        closing_note(report),
        "",
    ]
    return "\n".join(out)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = plots.pyplot("kvoffload bench offload --out")

    labels, names, by = _rows(report)
    caps = report["capacities"]
    xs = [caps[lb]["capacity"] for lb in labels]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(names):
        ys = [100 * by[name][lb]["hit_rate"] for lb in labels]
        ax.plot(
            xs,
            ys,
            marker="o",
            linewidth=2.5 if name == report["default_policy"] else 1.2,
            label=name,
            color=colors[i % len(colors)],
        )
    ax.plot(xs, [100 * caps[lb]["belady_hit_rate"] for lb in labels], "k--", label="Belady MIN")
    ax.axhline(100 * report["ceiling_hit_rate"], color="grey", linestyle=":", label="ceiling")
    ax.set_xscale("log")
    ax.set_xlabel("CPU tier capacity (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(str(report["trace"]))
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """``table.md`` and ``plot.png`` in ``out`` (created); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "table.md", out / "plot.png"
    md.write_text(markdown(report), encoding="utf-8")
    plot(report, png)
    return [md, png]
