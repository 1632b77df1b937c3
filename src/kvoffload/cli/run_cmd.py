"""``kvoffload run``: the main job on its embedded default.

The reference engine serves the built-in multi-turn chat workload with a GPU
tier too small for the working set and a CPU tier behind it, then prints
hit rates per tier, prefill tokens computed, TTFT and throughput.
"""

from __future__ import annotations

import argparse
import json

from kvoffload.cli import argtypes
from kvoffload.cli.engine_args import add_engine_arguments, engine_config_from_args

# The trace is generated up front; beyond this a run takes days on the reference
# engine and its trace alone would not fit in memory.
MAX_REQUESTS = 100_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--requests",
        type=argtypes.positive_int(MAX_REQUESTS),
        default=256,
        help=f"turns to serve (at most {MAX_REQUESTS:,})",
    )
    w.add_argument("--concurrency", type=argtypes.positive_int(1 << 16), default=8)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="serve the workload twice, offload off and with --store-mode, and compare "
        "every sampled logits row and token bit for bit (exit 1 if any differs)",
    )


def run(args: argparse.Namespace) -> int:
    from kvoffload.engine.demo.serving import demo_workload, serve

    if args.verify:
        return run_verify(args)
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


def run_verify(args: argparse.Namespace) -> int:
    """Offload off vs ``--store-mode``: 0 when every logits row and token is identical."""
    from kvoffload.engine.demo.serving import demo_workload, serve
    from kvoffload.engine.demo.verify import Recorder, compare
    from kvoffload.engine.model_runner import peek_vocab_size

    config = engine_config_from_args(args, record_logits=True)
    if not config.offload_enabled:
        raise ValueError(
            "--verify compares offload off with a store mode: give --store-mode eager or lazy"
        )
    # The reference never offloads; events would only be published twice.
    reference = engine_config_from_args(
        args,
        record_logits=True,
        store_mode="off",
        events_endpoint=None,
        events_replay_endpoint=None,
    )
    workload = demo_workload(peek_vocab_size(config), args.requests, seed=config.seed)
    recorded = []
    summaries = []
    for label, cfg in (("off", reference), (config.store_mode, config)):
        rec = Recorder()
        summaries.append(
            serve(
                cfg,
                workload,
                args.concurrency,
                label=label,
                show_progress=not args.json,
                on_output=rec,
            )
        )
        recorded.append(rec.outputs)
    report = compare(recorded[0], recorded[1])
    if args.json:
        print(json.dumps({"verify": report.as_dict(), "results": [s.as_dict() for s in summaries]}))
    else:
        print_summary(summaries, f"verify: off vs {config.store_mode}")
        print(report.line())
        if not report.identical:
            print(f"largest difference in a logits entry: {report.max_abs_diff:.3g}")
    return 0 if report.identical else 1


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
