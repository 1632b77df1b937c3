"""``kvoffload bench threads``: `kvoffload run` quiet, then beside a busy process.

A serving engine shares its machine. This benchmark serves the run workload
in a fresh process on a quiet machine, then again while a busy-looping process
(started and stopped here) keeps one core busy, and prints both wall times
and their ratio. The engine's threading policy (``kvoffload.engine.threads``)
is meant to keep the ratio at or below 2.0 without slowing the quiet run.

Each run is a separate ``python -m kvoffload.cli run --json`` process, so
thread-pool settings that take effect at start-up (OpenMP's wait policy) apply
as they would for a user. ``--env KEY=VALUE`` sets environment variables of
those runs (for comparing policies); the busy process is never given them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from kvoffload.cli import argtypes

# Not kvoffload.cli.engine_args: importing it sets this process's OMP_WAIT_POLICY,
# which the measured runs would inherit even when --env asks for another.
positive_int = argtypes.positive_int(1 << 20)

BUSY_LOOP = "while True:\n    pass\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=256, help="turns per run")
    parser.add_argument(
        "--busy", type=positive_int, default=1, help="busy-looping processes beside the loaded run"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=1, help="quiet/loaded pairs (medians reported)"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the measured runs (repeatable), e.g. KVOFFLOAD_THREADS=2",
    )
    parser.add_argument(
        "--run-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `kvoffload run` (repeatable), e.g. --run-arg=--store-mode=lazy",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class RunTiming:
    wall_s: float  # the engine's serving wall time, as `kvoffload run` reports it
    process_s: float  # the whole process, start-up included
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float


def parse_env(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def run_once(requests: int, env: dict[str, str], extra: list[str]) -> RunTiming:
    """One `kvoffload run --json` in a fresh process."""
    cmd = [sys.executable, "-m", "kvoffload.cli", "run", "--json", "--requests", str(requests)]
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, *extra],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"`kvoffload run` failed (exit {proc.returncode}): {tail}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return RunTiming(
        wall_s=float(summary["wall_s"]),
        process_s=elapsed,
        ttft_p50_s=float(summary["ttft_p50_s"]),
        ttft_p99_s=float(summary["ttft_p99_s"]),
        throughput_tok_s=float(summary["throughput_tok_s"]),
    )


class BusyProcesses:
    """``n`` busy-looping Python processes, stopped (by their own handles) on exit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyProcesses:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP]))
        time.sleep(0.2)  # let them reach the loop before the measured run starts
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()


def measure(args: argparse.Namespace, progress: Callable[[], None] = lambda: None) -> dict:
    env = parse_env(args.env)
    quiet: list[RunTiming] = []
    loaded: list[RunTiming] = []
    for _ in range(args.repeat):
        quiet.append(run_once(args.requests, env, args.run_arg))
        progress()
        with BusyProcesses(args.busy):
            loaded.append(run_once(args.requests, env, args.run_arg))
        progress()
    q = statistics.median(t.wall_s for t in quiet)
    b = statistics.median(t.wall_s for t in loaded)
    return {
        "requests": args.requests,
        "busy_processes": args.busy,
        "repeat": args.repeat,
        "env": env,
        "cpus": os.cpu_count(),
        "quiet_wall_s": q,
        "busy_wall_s": b,
        "ratio": b / q if q > 0 else float("inf"),
        "quiet_runs": [t.__dict__ for t in quiet],
        "busy_runs": [t.__dict__ for t in loaded],
    }


def run(args: argparse.Namespace) -> int:
    parse_env(args.env)  # bad values fail before any run
    if args.json:
        print(json.dumps(measure(args)))
        return 0
    from kvoffload.bench.console import console, progress_bar, table

    with progress_bar("quiet / busy runs", 2 * args.repeat) as advance:
        report = measure(args, advance)
    rows = [
        (
            name,
            f"{r['wall_s']:.2f}",
            f"{r['ttft_p50_s']:.4f}",
            f"{r['ttft_p99_s']:.4f}",
            f"{r['throughput_tok_s']:,.0f}",
        )
        for name in ("quiet", "busy")
        for r in cast(list[dict[str, float]], report[f"{name}_runs"])
    ]
    title = (
        f"kvoffload run --requests {args.requests}: quiet vs {args.busy} busy process(es)"
        f", {report['cpus']} CPUs"
    )
    cols = ("machine", "wall (s)", "TTFT p50 (s)", "TTFT p99 (s)", "tok/s")
    console().print(table(title, cols, rows))
    print(
        f"busy/quiet wall time: {report['ratio']:.2f}x "
        f"({report['busy_wall_s']:.2f} s vs {report['quiet_wall_s']:.2f} s, medians)"
    )
    return 0
