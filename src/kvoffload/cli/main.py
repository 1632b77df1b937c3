"""The ``kvoffload`` command: ``run`` (the main job), ``bench <name>``, ``events``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, help). Modules are imported only when their command runs, so
# that `kvoffload bench blocks` does not pay for torch or ZMQ.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "blocks": ("kvoffload.bench.blocks", "free block queue churn vs a list baseline"),
    "offload": ("kvoffload.bench.offload", "offloading-manager policies vs LRU and Belady"),
    "transfer": ("kvoffload.bench.transfer", "GPU<->CPU block copy bandwidth vs bulk copy"),
    "serve": ("kvoffload.bench.serve", "the serving workload across offload configurations"),
    "tiers": ("kvoffload.bench.tiers", "disk and Redis tier throughput vs raw I/O"),
}
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kvoffload.cli.run_cmd", "serve the built-in multi-turn workload with CPU offload"),
    "events": ("kvoffload.cli.events_cmd", "print a KV event publisher's events live"),
}


def _load(module: str) -> object:
    return importlib.import_module(module)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the module of the command actually given is imported.
    wanted = list(argv[:2])
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in wanted[:1]:
            _load(module).add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        if wanted[:1] == ["bench"] and wanted[1:2] == [name]:
            _load(module).add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(_load(args._module).run(args) or 0)  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        # Bad input or an unusable resource: one clear line, not a traceback.
        print(f"kvoffload: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
