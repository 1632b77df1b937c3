"""``kvoffload bench vllm --hits``: how close a CPU-tier hit comes to a device hit (issue 31).

One engine subprocess serves the same prompts under six set-ups on five
engines, all up at once and taking turns request by request so that every
row sees the same machine load (``vllm_runner.run_interleaved``): 8 prefixes of 1,024-1,984
tokens, each followed by a 24-token suffix, visited round-robin, one request
at a time, greedy. Rows (TTFT of the revisits unless said):

- ``miss``: prefix caching off (the second visit's prompts);
- ``device hit``: vLLM's own KV cache holds every prefix;
- ``device hit, kvoffload on``: the same with ``KVOffloadConnector`` on, which then
  loads nothing: what the connector itself costs a hit;
- ``kvoffload hit``: vLLM's cache holds one request, so every revisit's
  prefix comes back from kvoffload's CPU tier (``KVOffloadConnector``, its
  default ``sync_load_budget_bytes``: the load runs in the step the hit is
  found);
- ``kvoffload hit, async``: the same with ``sync_load_budget_bytes=0``
  (loads between steps, the request waits for one: the path before issue 31);
- ``suffix alone``: the 24 suffix tokens as a prompt of their own (what a
  free cache would leave).

Per row: TTFT p50 / mean, ratio to the device hit with a 95% interval
(``ratio_interval``: requests paired by prompt, resampled; on a shared 2-core
machine two identical engines in one run differ by up to 0.07x, so a ratio
alone says little), share of the miss -> device-hit gap closed; for the
kvoffload rows the engine steps a hit waits between its lookup and its forward
pass, its load's GB/s against a bulk copy of the same bytes on the same thread
(``vllm_hit_profile``), and with ``--profile-hit`` where the time of a hit
goes, per hook. Outputs of every row are compared token for token with the
device hit's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload.bench.vllm.model import FIRST_WORD_ID, VOCAB_SIZE

#: (row label, engine name) of the two kvoffload rows.
OFFLOAD_ROWS = (
    ("kvoffload hit", "kvoffload"),
    ("kvoffload hit, whole loads", "kvoffload_whole"),
    ("kvoffload hit, async loads", "kvoffload_async"),
)
#: Set in an engine's environment, "0" or "1" forces ``KVOffloadWorker.stage_loads``
#: (read by ``hit_profile``'s connector when vLLM registers the KV caches).
STAGE_ENV = "KVOFFLOAD_HIT_STAGE_LOADS"

PROFILED = {
    "kv_connector": "ProfiledKVOffloadConnector",
    "kv_connector_module_path": "kvoffload.bench.vllm.hit_profile",
}
#: (layers, hidden) of the issue's two models.
MODELS = {"4x512": (4, 512), "8x1024": (8, 1024)}
SUFFIX = 24
BLOCK = 32


def hit_prompts(
    seed: int = 31, num_prefixes: int = 8, visits: int = 3, lo: int = 1024, hi: int = 1984
) -> list[list[list[int]]]:
    """``visits`` rounds of ``num_prefixes`` prompts: the same prefixes, a new suffix each round."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]

    prefixes = [tokens(rng.randint(lo, hi)) for _ in range(num_prefixes)]
    return [[p + tokens(SUFFIX) for p in prefixes] for _ in range(visits)]


def engine_specs(
    model: str, rounds: list[list[list[int]]], kv_bytes_per_token: int, profile_dir: Path
) -> list[dict[str, Any]]:
    """The engines of the table, in the order they run."""
    longest = max(len(p) for r in rounds for p in r)
    one_request = -(-longest // BLOCK) + 8
    every_prefix = len(rounds[0]) * one_request + 16
    cpu_bytes = int(1.25 * sum(len(p) for p in rounds[0]) * kv_bytes_per_token)
    base = {
        "model": model,
        "block_size": BLOCK,
        "max_model_len": BLOCK * (-(-longest // BLOCK) + 4),
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 4,
    }

    def visits(n: int) -> list[dict[str, Any]]:
        return [{"name": f"visit{v}", "prompts": rounds[v], "max_tokens": 2} for v in range(n)]

    def offload(
        name: str, budget: int | None, gpu_blocks: int = one_request, stage: str | None = None
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {"cpu_bytes": cpu_bytes}
        if budget is not None:
            extra["sync_load_budget_bytes"] = budget
        env = {"KVOFFLOAD_HIT_PROFILE": str(profile_dir / name)}
        if stage is not None:
            env[STAGE_ENV] = stage
        return dict(
            base,
            name=name,
            num_gpu_blocks=gpu_blocks,
            connector=PROFILED,
            extra_config=extra,
            env=env,
            phases=visits(len(rounds)),
        )

    return [
        dict(
            base,
            name="miss",
            num_gpu_blocks=one_request,
            enable_prefix_caching=False,
            phases=[
                {"name": "miss", "prompts": rounds[1], "max_tokens": 2},
                {"name": "suffix", "prompts": [p[-SUFFIX:] for p in rounds[1]], "max_tokens": 2},
            ],
        ),
        dict(base, name="device", num_gpu_blocks=every_prefix, phases=visits(len(rounds))),
        offload("kvoffload", None),
        # The same synchronous loads, copied whole before the forward pass (never staged).
        offload("kvoffload_whole", None, stage="0"),
        offload("kvoffload_async", 0),
        # A device hit with kvoffload on: what the connector costs a hit that loads nothing.
        offload("device_kvoffload", None, every_prefix),
    ]


def _ttfts(engine: dict[str, Any], phases: Sequence[str]) -> list[float]:
    return [
        1e3 * r["ttft_s"] for p in engine["phases"] if p["name"] in phases for r in p["requests"]
    ]


def ratio_interval(
    row: Sequence[float], base: Sequence[float], draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of ``mean(row) / mean(base)``, the requests paired.

    ``row[i]`` and ``base[i]`` are the same prompt on two engines (the same
    visit, so the same machine moment, give or take a request); resampling
    pairs keeps what the prompts share (their prefix lengths) out of the spread.
    """
    import numpy as np

    a, b = np.asarray(row, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"ratio_interval needs paired samples, got {a.size} and {b.size}")
    picks = np.random.default_rng(seed).integers(0, a.size, (draws, a.size))
    ratios = a[picks].mean(axis=1) / b[picks].mean(axis=1)
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return float(lo), float(hi)


def _tokens(engine: dict[str, Any], phase: str) -> list[list[int]]:
    return [r["tokens"] for p in engine["phases"] if p["name"] == phase for r in p["requests"]]


def profile_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-hit means of a kvoffload engine's profile (see ``vllm_hit_profile``)."""
    hits = [r for r in records if r["kind"] == "hit"]
    loads = [r for r in records if r["kind"] == "load_step"]
    done = [r for r in records if r["kind"] == "load_done"]
    bulk = [r for r in records if r["kind"] == "bulk"]
    sched = [r for r in records if r["kind"] == "sched_step"]
    updates = [r for r in records if r["kind"] == "sched_update"]
    wsteps = [r for r in records if r["kind"] == "worker_step"]
    fwd = [r for r in records if r["kind"] == "forward_waits"]
    n = max(len(hits), 1)
    # What the step that loads waits for its loads: submission and synchronous waits
    # before the forward pass, and the forward pass's waits for copies still running.
    blocking_s = sum(r["start_s"] for r in loads) + sum(r["layer_s"] + r["save_s"] for r in fwd)

    def mean_ms(rows: list[dict[str, Any]], key: str, per: float = n) -> float:
        return 1e3 * sum(r[key] for r in rows) / per if rows else 0.0

    load_bytes = sum(r["bytes"] for r in done)
    # Medians of per-copy rates: one descheduled copy on a shared host would
    # otherwise weigh as much as all the others together.
    load_gbps = _median_rate(done)
    walls = [{"bytes": r["bytes"], "seconds": r.get("wall_s") or 0.0} for r in done]
    copies = [{"bytes": r["bytes"], "seconds": r.get("copy_s") or 0.0} for r in done]
    cpus = [{"bytes": r["bytes"], "seconds": r.get("copy_cpu_s") or 0.0} for r in done]
    bulk_gbps = _median_rate(bulk)
    hot = [{"bytes": r["bytes"], "seconds": r.get("hot_seconds", 0.0)} for r in bulk]
    return {
        "hits": len(hits),
        "hit_tokens": sum(h.get("hit_tokens", 0) for h in hits),
        "sync_hits": sum(1 for h in hits if h["sync"]),
        "steps_waited_mean": statistics.fmean(h["steps_waited"] for h in hits) if hits else 0.0,
        "steps_waited_max": max((h["steps_waited"] for h in hits), default=0),
        "wait_ms_mean": 1e3 * statistics.fmean(h.get("wait_s", 0.0) for h in hits) if hits else 0.0,
        "load_mb_mean": load_bytes / max(len(done), 1) / 1e6,
        "load_gbps": load_gbps,
        "load_wall_gbps": _median_rate(walls),
        "load_copy_gbps": _median_rate(copies),
        "load_copy_cpu_gbps": _median_rate(cpus),
        "bulk_gbps": bulk_gbps,
        "bulk_hot_gbps": _median_rate(hot),
        "load_vs_bulk": load_gbps / bulk_gbps if bulk_gbps else 0.0,
        "blocking_ms": 1e3 * blocking_s / n,
        "blocking_gbps": load_bytes / blocking_s / 1e9 if blocking_s > 0 else 0.0,
        "breakdown_ms": {
            "scheduler lookup": mean_ms(hits, "lookup_s"),
            "scheduler load preparation": mean_ms(hits, "alloc_s"),
            "scheduler metadata (steps with a load)": mean_ms(sched, "meta_s"),
            "scheduler load-finished handling": mean_ms(updates, "update_s"),
            "worker start_load_kv (submit + sync wait)": mean_ms(loads, "start_s"),
            "  of which the copy (may run under the forward pass)": mean_ms(done, "seconds"),
            "forward pass waiting for a layer's copy": mean_ms(fwd, "layer_s"),
            "end of forward pass (loads finished, stores queued)": mean_ms(fwd, "save_s"),
            "worker completion polling (get_finished)": mean_ms(wsteps, "finished_s"),
            "worker metadata": mean_ms(wsteps, "meta_s"),
        },
    }


def _median_rate(rows: list[dict[str, Any]]) -> float:
    rates = [r["bytes"] / r["seconds"] / 1e9 for r in rows if r["seconds"] > 0]
    return statistics.median(rates) if rates else 0.0


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The table's rows from the runner's result."""
    engines = {e["name"]: e for e in result["engines"]}
    revisits = [p["name"] for p in engines["device"]["phases"]][1:]
    device_ttfts = _ttfts(engines["device"], revisits)
    rows: dict[str, dict[str, Any]] = {}
    for label, name, phases in (
        ("miss", "miss", ["miss"]),
        ("device hit", "device", revisits),
        ("kvoffload hit", "kvoffload", revisits),
        ("kvoffload hit, whole loads", "kvoffload_whole", revisits),
        ("kvoffload hit, async loads", "kvoffload_async", revisits),
        ("device hit, kvoffload on", "device_kvoffload", revisits),
        ("suffix alone", "miss", ["suffix"]),
    ):
        ttft = _ttfts(engines[name], phases)
        # vLLM's counters are per process, not per engine: with four engines in
        # one process they are not read here (the profile counts the hits).
        rows[label] = {
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_mean_ms": statistics.fmean(ttft),
        }
        if phases == revisits and name != "device":  # the device hit's prompts: paired
            rows[label]["x_device_hit_95"] = ratio_interval(ttft, device_ttfts)
    device = rows["device hit"]["ttft_mean_ms"]
    miss = rows["miss"]["ttft_mean_ms"]
    for row in rows.values():
        row["x_device_hit"] = row["ttft_mean_ms"] / device if device else 0.0
        row["gap_closed"] = (miss - row["ttft_mean_ms"]) / (miss - device) if miss > device else 0.0
    for label, name in OFFLOAD_ROWS:
        rows[label]["profile"] = profile_summary(engines[name].get("hit_profile", []))
    # Greedy outputs: every row's second-visit tokens against the device hit's.
    want = _tokens(engines["device"], "visit1")
    same = {
        label: sum(a == b for a, b in zip(want, _tokens(engines[name], phase)))
        for label, name, phase in (
            ("miss", "miss", "miss"),
            ("kvoffload hit", "kvoffload", "visit1"),
            ("kvoffload hit, whole loads", "kvoffload_whole", "visit1"),
            ("kvoffload hit, async loads", "kvoffload_async", "visit1"),
            ("device hit, kvoffload on", "device_kvoffload", "visit1"),
        )
    }
    return {"rows": rows, "identical_outputs": same, "compared": len(want)}


def bench_model(
    python: Path,
    model_dir: Path,
    layers: int,
    hidden: int,
    visits: int,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    from kvoffload.bench.vllm.driver import ensure_model, run_engines

    model = ensure_model(python, model_dir, layers=layers, hidden=hidden)
    rounds = hit_prompts(visits=visits)
    kv_bytes_per_token = layers * 2 * max(1, hidden // 64) * 32 * 4  # K and V, float32
    with tempfile.TemporaryDirectory(prefix="kvoffload-hits-") as tmp:
        engines = engine_specs(str(model), rounds, kv_bytes_per_token, Path(tmp))
        result = run_engines(
            python, engines, timeout_s=1800, on_progress=on_progress, interleave=True
        )
    summary = summarize(result)
    summary.update(vllm_version=result["vllm_version"], layers=layers, hidden=hidden)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--hits`` flags of ``kvoffload bench vllm``."""
    from kvoffload.cli import argtypes

    parser.add_argument(
        "--hits",
        action="store_true",
        help="issue 31's table instead: TTFT of a miss, a device hit, a kvoffload CPU-tier "
        "hit (sync and async loads) and the suffix alone, steps a hit waits, load GB/s",
    )
    parser.add_argument(
        "--profile-hit",
        action="store_true",
        help="with the --hits table, where a hit's time goes per connector hook",
    )
    parser.add_argument(
        "--hit-models",
        nargs="+",
        choices=("4x512", "8x1024"),
        default=["4x512"],
        help="--hits models, layers x hidden (default: %(default)s)",
    )
    parser.add_argument(
        "--hit-visits",
        type=argtypes.positive_int(16, minimum=2),
        default=3,
        help="--hits visits per prefix, the first one cold (default: %(default)s)",
    )


def total_work(visits: int) -> int:
    rounds = 8 * visits
    return 6 + 16 + rounds * 5  # engine starts, miss + suffix, five engines' visits


def run(args: argparse.Namespace) -> int:
    import json

    from kvoffload.bench.console import progress_bar
    from kvoffload.bench.vllm.driver import default_model_dir, find_engine_python

    python = find_engine_python(args.engine_python)
    if python is None:
        raise FileNotFoundError("no vLLM engine environment (see `kvoffload bench vllm --help`)")
    models = [MODELS[m] for m in args.hit_models]
    reports = []
    with progress_bar("vLLM hit bench", len(models) * total_work(args.hit_visits)) as advance:
        for layers, hidden in models:
            model_dir = default_model_dir().with_name(f"tiny-llama-{layers}x{hidden}")
            reports.append(
                bench_model(
                    python,
                    model_dir,
                    layers,
                    hidden,
                    args.hit_visits,
                    on_progress=advance,
                )
            )
    if args.json:
        print(json.dumps({"models": reports}))
    else:
        for report in reports:
            print_report(report, args.profile_hit)
    ok = all(
        v == r["compared"]
        for r in reports
        for k, v in r["identical_outputs"].items()
        if k != "miss"
    )
    return 0 if ok else 1


_HIT_COLUMNS = (
    "row",
    "p50 ms",
    "mean ms",
    "x device hit (95%)",
    "gap closed",
    "steps, ms waited",
    "load MB",
    "load GB/s",
    "wall / copy / CPU",
    "bulk GB/s",
    "hot bulk",
    "load/bulk",
    "blocking ms",
    "blocking GB/s",
)
_KVOFFLOAD_HIT_ROWS = tuple(label for label, _ in OFFLOAD_ROWS)


def _profile_cells(prof: dict[str, Any] | None) -> list[str]:
    """The profile's columns of one row (blank without ``--profile-hit``)."""
    if not prof:
        return [""] * 9
    bulk = bool(prof["bulk_gbps"])
    return [
        f"{prof['steps_waited_mean']:.2f} (max {prof['steps_waited_max']}), "
        f"{prof['wait_ms_mean']:.1f} ms",
        f"{prof['load_mb_mean']:.1f}",
        f"{prof['load_gbps']:.1f}",
        " / ".join(
            f"{prof.get(k, 0.0):.1f}"
            for k in ("load_wall_gbps", "load_copy_gbps", "load_copy_cpu_gbps")
        ),
        f"{prof['bulk_gbps']:.1f}" if bulk else "-",
        f"{prof['bulk_hot_gbps']:.1f}" if bulk else "-",
        f"{prof['load_vs_bulk']:.2f}" if bulk else "-",
        f"{prof['blocking_ms']:.2f}",
        f"{prof['blocking_gbps']:.1f}",
    ]


def _hit_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(
        title=f"TTFT of a revisit, vLLM {report['vllm_version']} CPU engine, "
        f"{report['layers']} layers x hidden {report['hidden']} (serial requests, greedy)"
    )
    for col in _HIT_COLUMNS:
        t.add_column(col, justify="right")
    for label, row in report["rows"].items():
        t.add_row(
            label,
            f"{row['ttft_p50_ms']:.1f}",
            f"{row['ttft_mean_ms']:.1f}",
            f"{row['x_device_hit']:.2f}x"
            + (
                " ({:.2f}-{:.2f})".format(*row["x_device_hit_95"])
                if "x_device_hit_95" in row
                else ""
            ),
            f"{100 * row['gap_closed']:.1f}%",
            *_profile_cells(row.get("profile")),
        )
    return t


def _breakdown_table(report: dict[str, Any]) -> Any:
    """Per connector hook, the time of a kvoffload hit and its share of the gap to a device hit."""
    from rich.table import Table

    device = report["rows"]["device hit"]["ttft_mean_ms"]
    b = Table(title="per hit: where the time between a device hit and a kvoffload hit goes (ms)")
    b.add_column("hook")
    for label in _KVOFFLOAD_HIT_ROWS:
        b.add_column(label, justify="right")
        b.add_column("share of gap", justify="right")
    names = list(report["rows"]["kvoffload hit"]["profile"]["breakdown_ms"])
    for name in names:
        cells = []
        for label in _KVOFFLOAD_HIT_ROWS:
            row = report["rows"][label]
            gap = row["ttft_mean_ms"] - device
            ms = row["profile"]["breakdown_ms"][name]
            cells += [f"{ms:.2f}", f"{100 * ms / gap:.0f}%" if gap > 0 else "-"]
        b.add_row(name, *cells)
    gaps = []
    for label in _KVOFFLOAD_HIT_ROWS:
        gap = report["rows"][label]["ttft_mean_ms"] - device
        gaps += [f"{gap:.2f}", "100%"]
    b.add_row("TTFT over the device hit", *gaps)
    return b


def print_report(report: dict[str, Any], breakdown: bool) -> None:
    from rich.console import Console

    console = Console(width=max(Console().width, 200))  # piped: every row on one line
    console.print(_hit_table(report))
    same = ", ".join(
        f"{k} {v}/{report['compared']}" for k, v in report["identical_outputs"].items()
    )
    console.print(f"outputs identical to the device hit's: {same}")
    console.print(
        "load GB/s: what vLLM's kv_offload metric reports; wall / copy / CPU: the load "
        "job's bytes over its time from submit to done, over the time its parts ran "
        "(each from its start to its end), and over its threads' CPU time while they "
        "ran (a load copied layer by layer "
        "runs under the forward pass, sharing the cores); blocking: the time the step "
        "that loads waited for it (submission, synchronous waits, the forward pass "
        "waiting for a layer's copy), and the bytes over that time"
    )
    if breakdown:
        console.print(_breakdown_table(report))
