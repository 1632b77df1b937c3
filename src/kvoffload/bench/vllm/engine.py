"""``kvoffload bench vllm``: a real vLLM engine on the CPU, offload off and on, same prompts.

vLLM's CPU build runs in its own venv (docs/vllm.md, "CPU-only vLLM"): this module never
imports vLLM, it drives ``runner`` there through ``driver``, as tests/e2e_vllm do.
Workloads (token ids only): ``round_robin``, 8 prefixes of 300-600 tokens each visited 4
times in turn (a new 8-token suffix per visit), one at a time, so that with a 48-block
device cache every revisit misses the device tier; ``batch``, rounds of 4 concurrent
requests of 200-350 tokens under chunked prefill, alternating two sets of prefixes so each
set's second round finds its prefixes evicted from the device tier.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload.bench.vllm import hits as vllm_hits
from kvoffload.bench.vllm.driver import (
    ENGINE_PYTHON_ENV,
    ENGINE_VENV,
    default_model_dir,
    ensure_model,
    find_engine_python,
    run_engines,
    work_units,
)
from kvoffload.bench.vllm.model import FIRST_WORD_ID, VOCAB_SIZE

#: One offloaded block of the tiny model in float32: 2 layers x K,V x 2 heads x 32 x 32 tokens.
TINY_BLOCK_BYTES = 2 * 2 * 2 * 32 * 32 * 4


# -- workloads -----------------------------------------------------------------


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]


def round_robin_prompts(
    seed: int = 0,
    num_prefixes: int = 8,
    visits: int = 4,
    min_len: int = 300,
    max_len: int = 600,
    suffix_len: int = 8,
) -> list[list[int]]:
    """Prefixes visited round-robin, each visit with its own suffix."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(min_len, max_len)) for _ in range(num_prefixes)]
    return [prefix + _tokens(rng, suffix_len) for _ in range(visits) for prefix in prefixes]


def batch_rounds(
    seed: int = 1,
    batch: int = 4,
    rounds: int = 4,
    min_len: int = 200,
    max_len: int = 350,
    suffix_len: int = 8,
) -> list[list[list[int]]]:
    """``rounds`` rounds of ``batch`` concurrent prompts; even and odd rounds: two prefix sets."""
    rng = random.Random(seed)
    sets = [[_tokens(rng, rng.randint(min_len, max_len)) for _ in range(batch)] for _ in range(2)]
    return [[p + _tokens(rng, suffix_len) for p in sets[r % 2]] for r in range(rounds)]


def workload_phases(
    names: Sequence[str] = ("round_robin", "batch"), max_tokens: int = 8
) -> list[dict[str, Any]]:
    """Runner phases for the named workloads (``batch`` is one phase per round)."""
    phases: list[dict[str, Any]] = []
    for name in names:
        if name == "round_robin":
            phases.append(
                {"name": name, "prompts": round_robin_prompts(), "max_tokens": max_tokens}
            )
        elif name == "batch":
            for r, prompts in enumerate(batch_rounds()):
                phases.append(
                    {
                        "name": f"batch{r}",
                        "prompts": prompts,
                        "concurrent": True,
                        "max_tokens": max_tokens,
                    }
                )
        else:
            raise ValueError(f"unknown workload {name!r}; known: round_robin, batch")
    return phases


# -- the benchmark -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvoffload.cli import argtypes

    parser.add_argument(
        "--model",
        type=argtypes.existing_dir,
        default=None,
        help="a model directory vLLM can load (default: the tiny random Llama, made once "
        "under ~/.cache/kvoffload)",
    )
    parser.add_argument(
        "--engine-python",
        type=argtypes.existing_file,
        default=None,
        help=f"Python of an environment with vLLM's engine (default: ${ENGINE_PYTHON_ENV} or "
        f"{ENGINE_VENV}/bin/python; `make engine` builds it)",
    )
    parser.add_argument(
        "--workload",
        choices=("round_robin", "batch", "both"),
        default="both",
        help="round_robin: 8 prefixes x 4 visits, one at a time; batch: rounds of 4 "
        "concurrent requests under chunked prefill (default: %(default)s)",
    )
    parser.add_argument(
        "--connector",
        choices=("kvoffload", "stock"),
        default="kvoffload",
        help="KVOffloadConnector, or vLLM's OffloadingConnector with KVOffloadSpec "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--cpu-bytes",
        type=argtypes.byte_size(),
        default="16MiB",
        help="kvoffload's CPU tier (default: %(default)s)",
    )
    parser.add_argument(
        "--gpu-blocks",
        type=argtypes.positive_int(1 << 20, minimum=32),
        default=48,
        help="vLLM's device KV cache in blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=argtypes.positive_int(1024, minimum=32),
        default=32,
        help="tokens per block, a multiple of 32 on vLLM's CPU backend (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=argtypes.positive_int(1024),
        default=8,
        help="output tokens per request (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=argtypes.positive_int(1 << 20, minimum=64),
        default=1024,
        help="vLLM's max_model_len (default: %(default)s)",
    )
    vllm_hits.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def summarize(engine: dict[str, Any]) -> dict[str, Any]:
    """Cached tokens, TTFT p50/p99 and throughput of one engine's result."""
    requests = [r for p in engine["phases"] for r in p["requests"]]
    ttft = [r["ttft_s"] for r in requests]
    wall = sum(p["wall_s"] for p in engine["phases"])
    totals = {
        k: int(sum(p["counters"][k] for p in engine["phases"]))
        for k in ("prompt_tokens", "prefix_cache_hits", "external_prefix_cache_hits")
    }
    out_tokens = sum(len(r["tokens"]) for r in requests)
    return {
        "requests": len(requests),
        "prompt_tokens": totals["prompt_tokens"],
        "device_cached_tokens": totals["prefix_cache_hits"],
        "kvoffload_cached_tokens": totals["external_prefix_cache_hits"],
        "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else 0.0,
        "ttft_p99_ms": 1e3 * _percentile(ttft, 0.99),
        "wall_s": wall,
        "prompt_tokens_per_s": totals["prompt_tokens"] / wall if wall else 0.0,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
        "engine_start_s": engine["init_s"],
    }


def bench(args: argparse.Namespace, on_progress: Callable[[int], None] | None = None) -> dict:
    python = find_engine_python(args.engine_python)
    if python is None:
        raise FileNotFoundError(
            f"no vLLM engine environment: `make engine` builds {ENGINE_VENV}, or pass "
            f"--engine-python / set {ENGINE_PYTHON_ENV}"
        )
    model = Path(args.model) if args.model else ensure_model(python, default_model_dir())
    if args.block_size % 32:
        raise ValueError(
            f"--block-size {args.block_size}: vLLM's CPU backend needs a multiple of 32"
        )
    names = ("round_robin", "batch") if args.workload == "both" else (args.workload,)
    base = {
        "model": str(model),
        "block_size": args.block_size,
        "num_gpu_blocks": args.gpu_blocks,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": 128,
        "phases": workload_phases(names, args.max_tokens),
    }
    engines = [
        dict(base, name="off"),
        dict(base, name="on", connector=args.connector, extra_config={"cpu_bytes": args.cpu_bytes}),
    ]
    result = run_engines(python, engines, timeout_s=1800, on_progress=on_progress)
    off, on = result["engines"]
    want = [r["tokens"] for p in off["phases"] for r in p["requests"]]
    got = [r["tokens"] for p in on["phases"] for r in p["requests"]]
    same = sum(a == b for a, b in zip(want, got))
    s_off, s_on = summarize(off), summarize(on)
    return {
        "vllm_version": result["vllm_version"],
        "model": str(model),
        "workloads": list(names),
        "connector": args.connector,
        "cpu_bytes": args.cpu_bytes,
        "gpu_blocks": args.gpu_blocks,
        "block_size": args.block_size,
        "off": s_off,
        "on": s_on,
        "identical_outputs": same,
        "requests": len(want),
        "ttft_p50_ratio": s_on["ttft_p50_ms"] / s_off["ttft_p50_ms"] if s_off["ttft_p50_ms"] else 0,
        "throughput_ratio": (
            s_on["prompt_tokens_per_s"] / s_off["prompt_tokens_per_s"]
            if s_off["prompt_tokens_per_s"]
            else 0
        ),
        "_work": work_units(engines),
    }


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.console import console, progress_bar, table

    if getattr(args, "hits", False) or getattr(args, "profile_hit", False):
        return vllm_hits.run(args)
    python = find_engine_python(args.engine_python)
    names = ("round_robin", "batch") if args.workload == "both" else (args.workload,)
    total = 2 * (1 + sum(len(p["prompts"]) for p in workload_phases(names)))
    with progress_bar("vLLM engine (2 starts, then requests)", total) as advance:
        report = bench(args, on_progress=advance)
    report.pop("_work", None)
    if args.json:
        print(json.dumps(report))
        return 0 if report["identical_outputs"] == report["requests"] else 1
    cols = ["offload", "requests", "prompt tok", "device cached", "kvoffload cached"]
    cols += ["TTFT p50 ms", "TTFT p99 ms", "prompt tok/s", "output tok/s", "engine start s"]
    rows = [
        (
            name,
            str(s["requests"]),
            f"{s['prompt_tokens']:,}",
            f"{s['device_cached_tokens']:,}",
            f"{s['kvoffload_cached_tokens']:,}",
            f"{s['ttft_p50_ms']:.1f}",
            f"{s['ttft_p99_ms']:.1f}",
            f"{s['prompt_tokens_per_s']:,.0f}",
            f"{s['output_tokens_per_s']:,.0f}",
            f"{s['engine_start_s']:.0f}",
        )
        for name, s in ((n, report[n]) for n in ("off", "on"))
    ]
    out = console(120)
    out.print(
        table(
            f"real vLLM {report['vllm_version']} engine on the CPU, offload off vs on "
            f"({', '.join(report['workloads'])}; {report['gpu_blocks']} device blocks of "
            f"{report['block_size']} tokens)",
            cols,
            rows,
            caption=f"model {report['model']}; on = {report['connector']} connector, CPU tier "
            f"{report['cpu_bytes']:,} bytes; engine {python}",
        )
    )
    ok = report["identical_outputs"] == report["requests"]
    out.print(
        f"identical output tokens: {report['identical_outputs']}/{report['requests']} "
        f"({'ok' if ok else 'MISMATCH'}); TTFT p50 on/off {report['ttft_p50_ratio']:.2f}x, "
        f"prompt throughput on/off {report['throughput_ratio']:.2f}x"
    )
    return 0 if ok else 1
