"""``kvoffload bench serve``: the serving workload across offload configurations.

One run serves the same seeded trace with offload off, eager and lazy, and
each CPU-tier policy, side by side; writes the full table as markdown and a
PNG plot (hit rate per tier and TTFT per configuration) and prints a summary
that fits 80 columns. By default the CPU tier is sized under pressure (a
quarter of the workload's unique blocks), so that policies have something to
decide and their rows differ.

``--mooncake FILE`` replays a Mooncake trace without a model
(``kvoffload.bench.policy.mooncake``) to measure hit rates at scale: tiers are sized
from the trace unless given, every flag is honoured or refused, and the JSON
carries the settings, the infinite-tier ceiling, Belady's MIN, run time and
block-ops/s.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
import time
from pathlib import Path
from typing import Any

from kvoffload.bench import plots
from kvoffload.bench.console import markdown_table
from kvoffload.cli import argtypes
from kvoffload.cli.engine_args import add_engine_arguments


def _engine_dests() -> tuple[str, ...]:
    """Every engine flag's dest, read off the shared parser so none can be missed."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(probe)
    return tuple(a.dest for a in probe._actions)


# Engine flags whose absence we need to see (their defaults depend on the mode).
_ENGINE_DESTS = _engine_dests()
# What the Mooncake replay cannot use: it has block ids, no model and no KV bytes.
_MOONCAKE_REFUSED = {
    "model_path": "--model",
    "seed": "--seed",
    "kv_layout": "--kv-layout",
    "hash_fn": "--hash-fn",
    "cpu_bytes": "--cpu-bytes (no KV bytes without a model: give --cpu-blocks)",
    "disk_dir": "--disk-dir",
    "num_disk_blocks": "--disk-blocks",
    "redis_url": "--redis-url",
    "write_through": "--write-through",
    "events_endpoint": "--events-endpoint",
    "events_replay_endpoint": "--events-replay-endpoint",
    "max_num_seqs": "--max-num-seqs (use --concurrency: requests holding blocks)",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "dtype": "--dtype",
    "hash_seed": "--hash-seed",
    "num_threads": "--threads",
    "events_format": "--events-format",
}


class _Unset:
    """The default of an engine flag not given (not a string: argparse converts those)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces
MODEL_REQUESTS = 128
CPU_PRESSURE = 0.25  # default CPU tier: this share of the workload's unique blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    # UNSET unless given: the defaults differ between the model and Mooncake modes.
    parser.set_defaults(**dict.fromkeys(_ENGINE_DESTS, UNSET))
    parser.add_argument(
        "--requests",
        type=argtypes.positive_int(100_000),
        default=None,
        help=f"requests to serve (default {MODEL_REQUESTS}; with --mooncake: the whole trace)",
    )
    parser.add_argument(
        "--concurrency",
        type=argtypes.positive_int(1 << 16),
        default=8,
        help="requests in flight (with --mooncake: requests holding GPU blocks)",
    )
    parser.add_argument(
        "--policies",
        type=argtypes.name_list,
        default=None,
        help="comma-separated CPU-tier policies (default: all registered)",
    )
    parser.add_argument(
        "--out",
        type=argtypes.output_dir,
        default=Path("bench-serve"),
        help="directory for the table and plot (default: bench-serve)",
    )
    parser.add_argument(
        "--mooncake",
        type=argtypes.existing_file,
        default=None,
        metavar="TRACE.jsonl",
        help="replay a Mooncake trace without a model instead",
    )
    parser.add_argument("--json", action="store_true")


def _given(args: argparse.Namespace, dest: str) -> bool:
    return getattr(args, dest, UNSET) is not UNSET


def _policies(args: argparse.Namespace) -> tuple[list[str], str]:
    """(policies to compare, the default policy); unknown names are a ValueError."""
    from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
    from kvoffload.offload.policies.registry import policy_names

    known = policy_names()
    policies = list(args.policies) if args.policies else list(known)
    default = args.cache_policy if _given(args, "cache_policy") else DEFAULT_CACHE_POLICY
    default = default or DEFAULT_CACHE_POLICY
    for p in [*policies, default]:
        if p not in known:
            raise ValueError(f"unknown cache policy {p!r}; known: {', '.join(known)}")
    if default not in policies:
        policies.insert(0, default)
    return list(dict.fromkeys(policies)), default


# -- the model workload ---------------------------------------------------------------------


def _fill_engine_defaults(args: argparse.Namespace, **defaults: object) -> argparse.Namespace:
    from kvoffload.engine.config import EngineConfig

    d = EngineConfig()
    filled = argparse.Namespace(**vars(args))
    for dest in _ENGINE_DESTS:
        if getattr(filled, dest, UNSET) is UNSET:
            setattr(filled, dest, defaults.get(dest, getattr(d, dest)))
    return filled


def workload_unique_blocks(workload: Any, block_size: int) -> int:
    """Distinct full blocks (prompt + reply) of the workload, without a model."""
    from kvoffload.engine.demo.workload import TraceHasher, generate_trace

    hasher = TraceHasher(block_size)
    seen = set()
    for req in generate_trace(workload):
        seen.update(hasher.hashes(req)[1])
    return len(seen)


def configurations(
    args: argparse.Namespace,
    policies: list[str],
    default_policy: str,
    only_mode: str | None = None,
) -> list[tuple[str, dict[str, object]]]:
    """(label, engine overrides) per compared configuration; the default policy's row ends in *.

    ``only_mode`` (``--store-mode`` when given) keeps that mode's rows beside
    the ``off`` baseline.
    """
    configs: list[tuple[str, dict[str, object]]] = [("off", {"store_mode": "off"})]
    configs.append(("lazy", {"store_mode": "lazy", "cache_policy": default_policy}))
    for p in policies:
        label = f"eager/{p}" + ("*" if p == default_policy else "")
        configs.append((label, {"store_mode": "eager", "cache_policy": p}))
    if only_mode is not None:
        configs = [(n, c) for n, c in configs if c["store_mode"] in ("off", only_mode)]
    if args.disk_dir or args.redis_url:
        lower = {"disk_dir": args.disk_dir, "redis_url": args.redis_url}
        configs = [(n, {**c, "disk_dir": None, "redis_url": None}) for n, c in configs]
        tiers = "+".join(t for t, v in (("disk", args.disk_dir), ("redis", args.redis_url)) if v)
        configs.append(
            (f"eager+{tiers}", {"store_mode": "eager", "cache_policy": default_policy, **lower})
        )
    return configs


FULL_COLUMNS = (
    "config",
    "GPU hit",
    "CPU hit",
    "lower hit",
    "prefill computed",
    "TTFT p50 (s)",
    "TTFT p99 (s)",
    "tok/s",
    "blocks stored",
    "blocks loaded",
    "preemptions",
    "wall (s)",
)


def _full_row(s: Any) -> list[str]:
    return [
        s.label,
        f"{s.hit_rate_gpu:.1%}",
        f"{s.hit_rate_cpu:.1%}",
        f"{s.hit_rate_lower:.1%}",
        f"{s.prefill_tokens_computed:,}",
        f"{s.ttft_p50_s:.4f}",
        f"{s.ttft_p99_s:.4f}",
        f"{s.throughput_tok_s:,.0f}",
        f"{s.blocks_stored:,}",
        f"{s.blocks_loaded:,}",
        f"{s.preemptions:,}",
        f"{s.wall_s:.1f}",
    ]


def narrow_table(summaries: list[Any]) -> list[str]:
    """The summary as plain lines of at most 80 characters (the full table is in the file)."""
    off = summaries[0].prefill_tokens_computed
    head = f"{'config':<18}{'GPU hit':>8}{'CPU hit':>8}{'lower':>7}{'prefill':>11}{'saved':>8}"
    head += f"{'TTFT p50':>10}{'tok/s':>9}"
    lines = [head, "-" * len(head)]
    for s in summaries:
        saved = 1 - s.prefill_tokens_computed / off if off else 0.0
        lines.append(
            f"{s.label[:17]:<18}{s.hit_rate_gpu:>8.1%}{s.hit_rate_cpu:>8.1%}"
            f"{s.hit_rate_lower:>7.1%}{s.prefill_tokens_computed:>11,}{saved:>+8.1%}"
            f"{s.ttft_p50_s * 1000:>8.1f}ms{s.throughput_tok_s:>9,.0f}"
        )
    return lines


def write_plot(summaries: list[Any], path: Path) -> None:
    plt = plots.pyplot("kvoffload bench serve")

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


def run_model(args: argparse.Namespace) -> int:
    plots.require("kvoffload bench serve")
    from kvoffload.cli.engine_args import engine_config_from_args
    from kvoffload.engine.demo.serving import demo_workload, serve
    from kvoffload.engine.model_runner import peek_vocab_size

    policies, default_policy = _policies(args)
    requests = args.requests or MODEL_REQUESTS
    probe = _fill_engine_defaults(args)
    workload = demo_workload(peek_vocab_size(engine_config_from_args(probe)), requests, probe.seed)
    unique = workload_unique_blocks(workload, probe.block_size)
    cpu_default = max(8, math.ceil(CPU_PRESSURE * unique))
    cpu_given = _given(args, "num_cpu_blocks") or _given(args, "cpu_bytes")
    only_mode = args.store_mode if _given(args, "store_mode") else None
    args = _fill_engine_defaults(args, num_cpu_blocks=cpu_default)
    base = engine_config_from_args(args)
    summaries = []
    for label, overrides in configurations(args, policies, default_policy, only_mode):
        cfg = engine_config_from_args(args, **overrides)
        summaries.append(
            serve(cfg, workload, args.concurrency, label=label, show_progress=not args.json)
        )
    cpu_size = (
        f"{base.cpu_bytes:,} bytes"
        if base.cpu_bytes is not None
        else f"{base.num_cpu_blocks:,} blocks" + ("" if cpu_given else " (default: 25% of unique)")
    )
    note = (
        f"{requests:,} requests, {unique:,} unique blocks of {base.block_size} tokens; "
        f"GPU tier {base.num_gpu_blocks:,} blocks, CPU tier {cpu_size}; "
        f"* the default policy ({default_policy})"
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(FULL_COLUMNS, map(_full_row, summaries))
    (out / "serve.md").write_text("\n".join(table) + f"\n\n{note}\n")
    write_plot(summaries, out / "serve.png")
    if args.json:
        print(
            json.dumps(
                {
                    "settings": {
                        "requests": requests,
                        "unique_blocks": unique,
                        "block_size": base.block_size,
                        "gpu_blocks": base.num_gpu_blocks,
                        "cpu_blocks": base.num_cpu_blocks,
                        "cpu_bytes": base.cpu_bytes,
                        "default_policy": default_policy,
                        "policies": policies,
                    },
                    "results": [s.as_dict() for s in summaries],
                    "table": str(out / "serve.md"),
                    "plot": str(out / "serve.png"),
                }
            )
        )
        return 0
    for line in narrow_table(summaries):
        print(line)
    print(textwrap.fill(note, 80))
    print(f"full table: {out / 'serve.md'}  plot: {out / 'serve.png'}")
    return 0


# -- Mooncake replay ------------------------------------------------------------------------


def mooncake_settings(args: argparse.Namespace, reqs: list[Any]) -> dict[str, Any]:
    """Tier sizes and replay settings: given flags, else sized from the trace."""
    from kvoffload.bench.policy.mooncake import check_block_size, longest_request, unique_blocks

    for dest, flag in _MOONCAKE_REFUSED.items():
        if _given(args, dest):
            raise ValueError(
                f"{flag.split(' ')[0]} is not supported with --mooncake (a block-id replay "
                f"without a model){flag[len(flag.split(' ')[0]) :]}"
            )
    block_size = args.block_size if _given(args, "block_size") else MOONCAKE_BLOCK_SIZE
    check_block_size(reqs, block_size)
    unique = unique_blocks(reqs, block_size)
    longest = longest_request(reqs, block_size)
    gpu = (
        args.num_gpu_blocks
        if _given(args, "num_gpu_blocks")
        else max(longest + 1, math.ceil(0.01 * unique) + 1)
    )
    cpu = args.num_cpu_blocks if _given(args, "num_cpu_blocks") else max(1, math.ceil(0.1 * unique))
    argtypes.check_fits_in_memory(  # the replay's own bookkeeping, ~200 B per block
        "the replay's block tables", 200 * (gpu + cpu)
    )
    return {
        "trace": str(args.mooncake),
        "requests": len(reqs),
        "unique_blocks": unique,
        "longest_request_blocks": longest,
        "block_size": block_size,
        "gpu_blocks": gpu,
        "gpu_blocks_from": "flag" if _given(args, "num_gpu_blocks") else "trace",
        "cpu_blocks": cpu,
        "cpu_blocks_from": "flag" if _given(args, "num_cpu_blocks") else "trace (10% of unique)",
        "store_mode": args.store_mode if _given(args, "store_mode") else "eager",
        "hold_requests": args.concurrency,
    }


def run_mooncake(args: argparse.Namespace) -> int:
    from kvoffload.bench.policy.mooncake import read_mooncake_trace, replay_mooncake
    from kvoffload.bench.policy.replay import belady_hit_rate, ceiling_hit_rate
    from kvoffload.bench.policy.traces import trace_keys

    policies, default_policy = _policies(args)
    reqs = sorted(read_mooncake_trace(args.mooncake), key=lambda r: r.timestamp)
    if args.requests is not None:
        reqs = reqs[: args.requests]
    if not reqs:
        raise ValueError(f"{args.mooncake}: empty trace")
    settings = mooncake_settings(args, reqs)
    settings.update(policies=policies, default_policy=default_policy)
    gpu, cpu, mode = settings["gpu_blocks"], settings["cpu_blocks"], settings["store_mode"]
    start = time.perf_counter()
    block_size = settings["block_size"]
    keys = trace_keys(reqs, block_size)
    reference = {
        "ceiling_hit_rate": ceiling_hit_rate(keys),
        "belady_hit_rate_gpu_plus_cpu": belady_hit_rate(keys, gpu + cpu),
        "belady_hit_rate_cpu": belady_hit_rate(keys, cpu),
    }
    hold = args.concurrency
    rows = {
        "gpu-only": replay_mooncake(
            reqs, gpu, None, hold_requests=hold, block_size=block_size
        ).as_dict()
    }
    if mode != "off":
        for p in policies:
            name = f"cpu/{p}" + ("*" if p == default_policy else "")
            rows[name] = replay_mooncake(reqs, gpu, cpu, p, hold, mode, block_size).as_dict()
    run_s = time.perf_counter() - start
    report = {"settings": settings, "reference": reference, "results": rows, "run_s": run_s}
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "mooncake.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "mooncake.md").write_text(mooncake_markdown(report))
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        textwrap.fill(
            f"Mooncake replay: {len(reqs):,} requests, {settings['unique_blocks']:,} unique "
            f"blocks of {settings['block_size']} tokens; GPU {gpu:,} / CPU {cpu:,} blocks "
            f"({mode}), holding {hold}",
            80,
        )
    )
    print(f"{'config':<18}{'GPU hit':>9}{'CPU hit':>9}{'total':>9}{'refused':>10}{'kops/s':>9}")
    for name, r in rows.items():
        print(
            f"{name[:17]:<18}{r['hit_rate_gpu']:>9.1%}{r['hit_rate_cpu']:>9.1%}"
            f"{r['hit_rate_total']:>9.1%}{r['stores_refused']:>10,}{r['ops_per_s'] / 1e3:>9,.0f}"
        )
    print(
        textwrap.fill(
            f"ceiling (infinite tier) {reference['ceiling_hit_rate']:.1%}; Belady's MIN at "
            f"GPU+CPU {reference['belady_hit_rate_gpu_plus_cpu']:.1%}, at CPU alone "
            f"{reference['belady_hit_rate_cpu']:.1%}; * the default policy ({default_policy})",
            80,
        )
    )
    print("kops/s: thousand CPU-tier block ops per second of replay (GPU pool included)")
    print(f"report: {out / 'mooncake.md'}  {out / 'mooncake.json'}  ({run_s:.1f} s)")
    return 0


def mooncake_markdown(report: dict[str, Any]) -> str:
    cols = ("config", "GPU hit", "CPU hit", "total hit", "offered", "stored", "refused", "ops/s")
    rows = [
        (
            name,
            f"{r['hit_rate_gpu']:.2%}",
            f"{r['hit_rate_cpu']:.2%}",
            f"{r['hit_rate_total']:.2%}",
            f"{r['blocks_offered']:,}",
            f"{r['blocks_stored']:,}",
            f"{r['stores_refused']:,}",
            f"{r['ops_per_s']:,.0f}",
        )
        for name, r in report["results"].items()
    ]
    ref = report["reference"]
    lines = [
        *markdown_table(cols, rows),
        "",
        f"Settings: {json.dumps(report['settings'])}",
        f"Ceiling {ref['ceiling_hit_rate']:.2%}; "
        f"Belady (GPU+CPU) {ref['belady_hit_rate_gpu_plus_cpu']:.2%}; "
        f"Belady (CPU) {ref['belady_hit_rate_cpu']:.2%}.",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.mooncake:
        return run_mooncake(args)
    return run_model(args)
