"""The ``kvoffload`` command: ``run`` (the main job), ``bench <name>``, ``events``.

Every failure a user can cause ends in one line on stderr, ``kvoffload: error:
...``, and exit status 2: argparse's own errors (printed without the usage
block), errors the commands raise for bad input or unusable resources, and, as
a safety net, anything unexpected (``KVOFFLOAD_DEBUG=1`` shows its traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

EXIT_USAGE = 2

# name -> (module, help). Modules are imported only when their command runs, so
# that `kvoffload bench blocks` and every --help do not pay for torch or ZMQ.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "blocks": ("kvoffload.bench.core.blocks", "free block queue churn vs a list baseline"),
    "offload": ("kvoffload.bench.policy.offload", "offloading-manager policies vs LRU and Belady"),
    "transfer": (
        "kvoffload.bench.transfer.bandwidth",
        "GPU<->CPU block copy bandwidth vs bulk copy",
    ),
    "serve": (
        "kvoffload.bench.serving.serve",
        "the serving workload across offload configurations",
    ),
    "tiers": ("kvoffload.bench.tiers.throughput", "disk and Redis tier throughput vs raw I/O"),
    "tiers-vllm": (
        "kvoffload.bench.tiers.vllm_fs",
        "kvoffload's disk tier vs vLLM's fs tier under vLLM's tiering manager",
    ),
    "threads": (
        "kvoffload.bench.serving.threads",
        "kvoffload run quiet vs beside a busy process (wall-time ratio)",
    ),
    "events": (
        "kvoffload.bench.core.events",
        "KV event publish/decode rates, vllm vs legacy profile",
    ),
    "route": (
        "kvoffload.bench.routing.route",
        "N engines behind a KV-aware router vs round robin, random",
    ),
    "hybrid": (
        "kvoffload.bench.policy.hybrid_replay",
        "KV cache groups: chunk units vs vLLM's lru / arc",
    ),
    "vllm": (
        "kvoffload.bench.vllm.engine",
        "a real vLLM engine on the CPU, offload off vs on (cached tokens, TTFT, identity)",
    ),
}
# Where a command's flags live when its module is heavy: --help must not import torch.
ARGUMENT_MODULES: dict[str, str] = {
    "kvoffload.bench.transfer.bandwidth": "kvoffload.bench.transfer.args"
}
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kvoffload.cli.run_cmd", "serve the built-in multi-turn workload with CPU offload"),
    "events": ("kvoffload.cli.events_cmd", "print a KV event publisher's events live"),
}


def one_line(text: object) -> str:
    """``text`` on a single line (newlines and runs of blanks folded)."""
    return " ".join(str(text).split())


def error_exit(message: object) -> NoReturn:
    print(f"kvoffload: error: {one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block): ``--help`` shows usage."""

    def error(self, message: str) -> NoReturn:
        error_exit(f"{self.prog}: {message} (see {self.prog} --help)")


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _load(module: str) -> object:
    return importlib.import_module(module)


def _add_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    _load(ARGUMENT_MODULES.get(module, module)).add_arguments(parser)  # type: ignore[attr-defined]


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvoffload", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the module of the command actually given is imported.
    wanted = list(argv[:2])
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in wanted[:1]:
            _add_arguments(module, p)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        if not _available(module):
            continue  # a benchmark whose module is not there yet
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        if wanted[:1] == ["bench"] and wanted[1:2] == [name]:
            _add_arguments(module, p)
        p.set_defaults(_module=module)
    return parser


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Error types that mean bad input or an unusable resource, not a bug.

    Looked up only among modules already imported, so that naming them costs
    no import (a command that never touched Redis cannot raise its errors).
    """
    types: list[type[BaseException]] = [ValueError, OSError, MemoryError, LookupError]
    for module, name in (
        ("kvoffload.bench.plots", "PlotsUnavailable"),
        ("kvoffload.tiers.disk.store", "DiskStoreError"),
        ("kvoffload.tiers.redis.store", "RedisStoreError"),
        ("kvoffload.tiers.mooncake.client", "MooncakeUnavailable"),
        ("kvoffload.tiers.tiered_handler", "JobRejected"),
        ("redis.exceptions", "RedisError"),
        ("safetensors", "SafetensorError"),
        ("zmq", "ZMQError"),
    ):
        mod = sys.modules.get(module)
        t = getattr(mod, name, None) if mod is not None else None
        if isinstance(t, type) and issubclass(t, BaseException):
            types.append(t)
    return tuple(types)


def describe_error(exc: BaseException) -> str:
    """The one-line message for ``exc``: expected errors as they are, others with their type."""
    text = one_line(exc) or type(exc).__name__
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "allocate" in text and "memory" in text.lower()
    ):  # torch's allocators raise RuntimeError("... can't allocate memory ...")
        return f"out of memory ({text}); use smaller sizes"
    if isinstance(exc, _expected_errors()):
        if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
            text = f"{exc.filename}: {text}"
        return text
    return f"{type(exc).__name__}: {text} (unexpected; KVOFFLOAD_DEBUG=1 shows the traceback)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a one-line usage error (2): a status, not a raise
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(_load(args._module).run(args) or 0)  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except BaseException as exc:  # the safety net: one line, never a traceback
        if os.environ.get("KVOFFLOAD_DEBUG"):
            raise
        print(f"kvoffload: error: {describe_error(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
