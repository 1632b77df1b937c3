"""The flags of ``kvoffload bench transfer``, kept apart so ``--help`` needs no torch."""

from __future__ import annotations

import argparse

from kvoffload.cli import argtypes
from kvoffload.engine.config import KV_LAYOUTS  # the transfer layer's LAYOUT_KINDS (tested equal)

DEFAULT_SIZES = "16KiB,64KiB,256KiB,1MiB,4MiB"
QUICK_SIZES = "16KiB,256KiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=argtypes.byte_size_list(1 << 40),
        default=None,
        help=f"comma-separated block sizes (all layers, K and V); default {DEFAULT_SIZES}",
    )
    parser.add_argument(
        "--blocks",
        type=argtypes.positive_int(1 << 24),
        default=1000,
        help="blocks per job (default 1000)",
    )
    parser.add_argument(
        "--layout",
        default="layer_first",
        choices=[*KV_LAYOUTS, "all"],
        help="KV layout of both tiers (default layer_first, the engine's); 'all' runs each",
    )
    parser.add_argument(
        "--layers", type=argtypes.positive_int(1024), default=4, help="model layers (default 4)"
    )
    parser.add_argument(
        "--kv-heads", type=argtypes.positive_int(1024), default=8, help="KV heads (default 8)"
    )
    parser.add_argument(
        "--head-size", type=argtypes.positive_int(4096), default=64, help="head size (default 64)"
    )
    parser.add_argument("--dtype", default="float16", help="KV dtype (default float16)")
    parser.add_argument(
        "--pattern",
        choices=("random", "chains", "sequential"),
        default="random",
        help="block ids: random on both sides, chains (request chains of 16 GPU ids, CPU "
        "slots in runs of 64), or sequential (default random)",
    )
    parser.add_argument(
        "--repeats",
        type=argtypes.positive_int(10_000),
        default=5,
        help="timed rounds, best kept (default 5)",
    )
    parser.add_argument(
        "--threads", type=argtypes.positive_int(1024), default=2, help="worker threads (CPU path)"
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="GPU tier device"
    )
    parser.add_argument("--seed", type=argtypes.any_int(2**63 - 1, 0), default=0)
    parser.add_argument(
        "--quick", action="store_true", help=f"small run for tests: {QUICK_SIZES}, 64 blocks"
    )
    parser.add_argument(
        "--against",
        metavar="REV[,REV...]",
        default=None,
        help="also measure these git revisions' copy path, interleaved with this one in one "
        "run (each revision's src/ in its own process): median and range of per-round ratios "
        "side by side (CPU path)",
    )
    parser.add_argument(
        "--rounds",
        type=argtypes.positive_int(10_000),
        default=5,
        help="interleaved rounds per revision and size with --against (default 5)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
