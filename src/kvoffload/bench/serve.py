"""``kvoffload bench serve``: the serving workload across offload configurations.

One run serves the same seeded trace with offload off, eager and lazy, and
each CPU-tier policy, side by side; writes a markdown table and a PNG plot
(hit rate per tier and TTFT per configuration). ``--mooncake FILE`` replays
a Mooncake trace without a model to measure hit rates at scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvoffload.bench.serving import ServeSummary, demo_workload, serve
from kvoffload.cli.engine_args import add_engine_arguments, engine_config_from_args, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--requests", type=positive_int, default=128)
    parser.add_argument("--concurrency", type=positive_int, default=8)
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated CPU-tier policies (default: all registered)",
    )
    parser.add_argument("--out", default="bench-serve", help="directory for the table and plot")
    parser.add_argument(
        "--mooncake",
        default=None,
        metavar="TRACE.jsonl",
        help="replay a Mooncake trace without a model instead",
    )
    parser.add_argument("--json", action="store_true")


def configurations(args: argparse.Namespace) -> list[tuple[str, dict[str, object]]]:
    from kvoffload.offload.policies.registry import policy_names

    policies = args.policies.split(",") if args.policies else list(policy_names())
    default_policy = args.cache_policy
    configs: list[tuple[str, dict[str, object]]] = [("off", {"store_mode": "off"})]
    configs.append(("eager", {"store_mode": "eager", "cache_policy": default_policy}))
    configs.append(("lazy", {"store_mode": "lazy", "cache_policy": default_policy}))
    for p in policies:
        configs.append((f"eager/{p}", {"store_mode": "eager", "cache_policy": p}))
    if args.disk_dir or args.redis_url:
        lower = {"disk_dir": args.disk_dir, "redis_url": args.redis_url}
        configs = [(n, {**c, "disk_dir": None, "redis_url": None}) for n, c in configs]
        tiers = "+".join(t for t, v in (("disk", args.disk_dir), ("redis", args.redis_url)) if v)
        configs.append((f"eager+{tiers}", {"store_mode": "eager", **lower}))
    return configs


def write_markdown(summaries: list[ServeSummary], path: Path) -> None:
    cols = [
        "config",
        "GPU hit",
        "CPU hit",
        "lower hit",
        "prefill computed",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "tok/s",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in summaries:
        lines.append(
            f"| {s.label} | {s.hit_rate_gpu:.1%} | {s.hit_rate_cpu:.1%} | {s.hit_rate_lower:.1%} "
            f"| {s.prefill_tokens_computed:,} | {s.ttft_p50_s:.4f} | {s.ttft_p99_s:.4f} "
            f"| {s.throughput_tok_s:,.0f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(summaries: list[ServeSummary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s.label for s in summaries]
    x = range(len(labels))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    gpu = [s.hit_rate_gpu * 100 for s in summaries]
    cpu = [s.hit_rate_cpu * 100 for s in summaries]
    low = [s.hit_rate_lower * 100 for s in summaries]
    ax1.bar(x, gpu, label="GPU tier")
    ax1.bar(x, cpu, bottom=gpu, label="CPU tier")
    ax1.bar(x, low, bottom=[g + c for g, c in zip(gpu, cpu)], label="disk/remote")
    ax1.set_ylabel("prompt tokens served from cache (%)")
    ax1.set_title("prefix hit rate per tier")
    ax1.set_xticks(list(x), labels, rotation=30, ha="right")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [s.ttft_p50_s * 1000 for s in summaries], 0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [s.ttft_p99_s * 1000 for s in summaries], 0.4, label="p99")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("time to first token")
    ax2.set_xticks(list(x), labels, rotation=30, ha="right")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_mooncake(args: argparse.Namespace) -> int:
    from kvoffload.bench.mooncake import read_mooncake_trace, replay_mooncake
    from kvoffload.offload.policies.registry import policy_names

    reqs = list(read_mooncake_trace(args.mooncake))
    if not reqs:
        raise ValueError(f"{args.mooncake}: empty trace")
    rows = {"gpu-only": replay_mooncake(reqs, args.num_gpu_blocks, None).as_dict()}
    for p in args.policies.split(",") if args.policies else policy_names():
        rows[f"cpu/{p}"] = replay_mooncake(
            reqs, args.num_gpu_blocks, args.num_cpu_blocks, p
        ).as_dict()
    if args.json:
        print(json.dumps({"trace": args.mooncake, "results": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"Mooncake replay: {len(reqs):,} requests, GPU {args.num_gpu_blocks} / "
        f"CPU {args.num_cpu_blocks} blocks"
    )
    for c in ("config", "GPU hit", "CPU hit", "total hit"):
        t.add_column(c, justify="right")
    for name, r in rows.items():
        t.add_row(
            name,
            f"{r['hit_rate_gpu']:.1%}",
            f"{r['hit_rate_cpu']:.1%}",
            f"{r['hit_rate_total']:.1%}",
        )
    Console().print(t)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.mooncake:
        return run_mooncake(args)
    from kvoffload.engine.model_runner import peek_vocab_size

    base = engine_config_from_args(args)
    workload = demo_workload(peek_vocab_size(base), args.requests, seed=base.seed)
    summaries = []
    for label, overrides in configurations(args):
        cfg = engine_config_from_args(args, **overrides)
        summaries.append(
            serve(cfg, workload, args.concurrency, label=label, show_progress=not args.json)
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_markdown(summaries, out / "serve.md")
    write_plot(summaries, out / "serve.png")
    if args.json:
        print(
            json.dumps(
                {
                    "results": [s.as_dict() for s in summaries],
                    "table": str(out / "serve.md"),
                    "plot": str(out / "serve.png"),
                }
            )
        )
        return 0
    from kvoffload.cli.run_cmd import print_summary

    print_summary(summaries)
    off = summaries[0]
    for s in summaries[1:]:
        saved = 1 - s.prefill_tokens_computed / off.prefill_tokens_computed
        print(
            f"{s.label:>16}: prefill computed {s.prefill_tokens_computed:,} vs "
            f"{off.prefill_tokens_computed:,} with offload off ({saved:+.1%} saved)"
        )
    print(f"table: {out / 'serve.md'}  plot: {out / 'serve.png'}")
    return 0
