"""``kvoffload run``: the main job on its embedded default.

The reference engine serves the built-in multi-turn chat workload with a GPU
tier too small for the working set and a CPU tier behind it, then prints
hit rates per tier, prefill tokens computed, TTFT and throughput.
"""

from __future__ import annotations

import argparse
import json

from kvoffload.cli.engine_args import add_engine_arguments, engine_config_from_args, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    w = parser.add_argument_group("workload")
    w.add_argument("--requests", type=positive_int, default=256, help="turns to serve")
    w.add_argument("--concurrency", type=positive_int, default=8)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.serving import demo_workload, serve

    config = engine_config_from_args(args)
    from kvoffload.engine.model_runner import peek_vocab_size

    workload = demo_workload(peek_vocab_size(config), args.requests, seed=config.seed)
    summary = serve(
        config, workload, args.concurrency, label="kvoffload run", show_progress=not args.json
    )
    if args.json:
        print(json.dumps(summary.as_dict()))
        return 0
    print_summary([summary], config.store_mode)
    return 0


def print_summary(summaries: list, title: str = "") -> None:  # list[ServeSummary]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvoffload run ({title})" if title else None)
    table.add_column("metric")
    for s in summaries:
        table.add_column(s.label or "value", justify="right")

    def row(name: str, fmt: str, attr: str) -> None:
        table.add_row(name, *[format(getattr(s, attr), fmt) for s in summaries])

    row("requests", ",", "requests")
    row("prompt tokens", ",", "prompt_tokens")
    row("output tokens", ",", "output_tokens")
    row("prefix hit rate, GPU tier", ".1%", "hit_rate_gpu")
    row("prefix hit rate, CPU tier", ".1%", "hit_rate_cpu")
    if any(s.hit_rate_lower for s in summaries):
        row("prefix hit rate, disk/remote tiers", ".1%", "hit_rate_lower")
    row("prefill tokens computed", ",", "prefill_tokens_computed")
    table.add_row(
        "prefill tokens without offload (est.)",
        *[
            format(
                s.prefill_tokens_computed
                + round((s.hit_rate_cpu + s.hit_rate_lower) * s.prompt_tokens),
                ",",
            )
            for s in summaries
        ],
    )
    row("TTFT p50 (s)", ".4f", "ttft_p50_s")
    row("TTFT p99 (s)", ".4f", "ttft_p99_s")
    row("throughput (tok/s)", ",.0f", "throughput_tok_s")
    row("blocks stored", ",", "blocks_stored")
    row("blocks loaded", ",", "blocks_loaded")
    row("preemptions", ",", "preemptions")
    row("wall time (s)", ".1f", "wall_s")
    Console().print(table)
