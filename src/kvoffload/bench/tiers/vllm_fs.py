"""``kvoffload bench tiers-vllm``: kvoffload's disk tier against vLLM's fs tier, both under vLLM.

Both tiers run as secondary tiers of vLLM's own ``TieringOffloadingManager``
(built by vLLM's ``TieringOffloadingSpec.get_manager()``), on the same
filesystem, with the same workload, in the same run; this process plays
vLLM's scheduler (the offloading connector's calls) and the GPU<->CPU
copies (memcpy into the shared CPU rows). Per block size (256 KiB and 1 MiB
rows by default):

- write MB/s: blocks stored into the CPU tier and cascaded by vLLM to the
  secondary tier, from the first ``prepare_store`` until every cascade job
  has finished (end to end through vLLM's manager, CPU tier backpressure
  included);
- read MB/s: a fresh engine over the same directory (empty CPU tier, so
  every block comes from the secondary tier) looks the blocks up as vLLM's
  connector does (``RETRY`` / ``HIT_PENDING`` until promoted, several
  requests in flight) and loads them; from the first lookup until the last
  block is loaded;
- scheduler-thread time per step: seconds spent in the manager's calls on
  this thread (lookups separately), per engine step;
- disk bytes in use after writing twice the disk budget (``--budget``):
  allocated bytes under each tier's directory (``st_blocks``); vLLM's fs tier
  has no bound.

Ratios are kvoffload / vLLM fs (higher is better for MB/s, lower for
scheduler time and bytes in use). vLLM's C file I/O (``vllm.fs_io_C``) needs
CUDA libraries; without them (a CPU machine) vLLM's fs tier takes its Python
path, which is what this measures there (reported as ``vllm_fs_io``).
Wall-clock figures on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.console import progress_bar
from kvoffload.bench.tiers.vllm_side import MODULE, Engine

DEFAULT_SIZES = "256KiB,1MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-sizes",
        default=DEFAULT_SIZES,
        help=f"offloaded block (row) sizes, comma separated (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--total",
        default="64MiB",
        help="bytes written (and read back) per block size (default 64MiB)",
    )
    parser.add_argument(
        "--budget",
        default="16MiB",
        help="kvoffload's disk budget for the bytes-in-use phase, which writes twice it "
        "(default 16MiB)",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="directory on the filesystem to measure (default: a temporary directory "
        "under $TMPDIR)",
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="blocks per store / per request (default 8)"
    )
    parser.add_argument(
        "--requests-in-flight",
        type=int,
        default=4,
        help="read requests looked up concurrently (default 4)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure; best kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- the measurements --------------------------------------------------------------------


def disk_bytes_in_use(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def _entries(root: Path, which: str, disk_bytes: int) -> dict[str, Any]:
    if which == "kvoffload":
        return {
            "type": "KVOffloadDiskTier",
            "module_path": MODULE,
            "disk_dir": str(root),
            "disk_bytes": disk_bytes,
        }
    return {"type": "fs", "root_dir": str(root)}


@dataclass
class TierFigures:
    write_mb_s: float = 0.0
    read_mb_s: float = 0.0
    sched_ms_per_step: float = 0.0
    sched_us_per_block: float = 0.0
    lookup_ms_per_step: float = 0.0
    steps: int = 0
    read_misses: int = 0


@dataclass
class SizeFigures:
    block_bytes: int
    blocks: int
    tiers: dict[str, TierFigures] = field(default_factory=dict)


def _keys(n: int, tag: str) -> list[Any]:
    import hashlib

    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(f"{tag}:{i}".encode()).digest(), 0) for i in range(n)]


def measure_size(
    base: Path, block_bytes: int, total: int, args: argparse.Namespace, progress: Any
) -> SizeFigures:
    n = max(args.batch, total // block_bytes)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (8, block_bytes), dtype=np.uint8)
    cpu_chunks = max(4 * args.batch, args.batch * args.requests_in_flight * 2)
    out = SizeFigures(block_bytes, n)
    for which in ("vllm_fs", "kvoffload"):
        runs = []
        for rep in range(args.repeat):
            root = base / f"{which}-{block_bytes}-{rep}"
            keys = _keys(n, f"{which}-{rep}")
            entry = _entries(root, which, max(2 * total, 1 << 20))
            eng = Engine(entry, block_bytes, cpu_chunks)
            try:
                w = eng.write(keys, data, args.batch)
                w_clock = eng.clock
            finally:
                eng.close()
            progress(f"{which} {block_bytes >> 10} KiB write")
            eng = Engine(entry, block_bytes, cpu_chunks)
            try:
                r = eng.read(keys, args.batch, args.requests_in_flight)
                misses = eng.misses
                r_clock = eng.clock
            finally:
                eng.close()
            progress(f"{which} {block_bytes >> 10} KiB read")
            steps = w_clock.steps + r_clock.steps
            runs.append(
                TierFigures(
                    write_mb_s=n * block_bytes / w / 1e6,
                    read_mb_s=n * block_bytes / r / 1e6,
                    sched_ms_per_step=(w_clock.seconds + r_clock.seconds) * 1e3 / max(1, steps),
                    sched_us_per_block=(w_clock.seconds + r_clock.seconds) * 1e6 / (2 * n),
                    lookup_ms_per_step=r_clock.lookup_seconds * 1e3 / max(1, r_clock.steps),
                    steps=steps,
                    read_misses=misses,
                )
            )
            shutil.rmtree(root, ignore_errors=True)
        # Best of the runs per figure: the scheduler's figures all from its fastest run.
        best = replace(min(runs, key=lambda f: f.sched_us_per_block))
        best.write_mb_s = max(f.write_mb_s for f in runs)
        best.read_mb_s = max(f.read_mb_s for f in runs)
        best.read_misses = max(f.read_misses for f in runs)
        out.tiers[which] = best
    return out


def measure_budget(base: Path, budget: int, args: argparse.Namespace, progress: Any) -> dict:
    block_bytes = 256 << 10
    n = 2 * budget // block_bytes
    data = np.random.default_rng(1).integers(0, 256, (8, block_bytes), dtype=np.uint8)
    used = {}
    for which in ("vllm_fs", "kvoffload"):
        root = base / f"{which}-budget"
        eng = Engine(_entries(root, which, budget), block_bytes, 4 * args.batch)
        try:
            eng.write(_keys(n, f"budget-{which}"), data, args.batch)
        finally:
            eng.close()
        used[which] = disk_bytes_in_use(root)
        shutil.rmtree(root, ignore_errors=True)
        progress(f"{which} budget")
    return {"budget_bytes": budget, "written_bytes": n * block_bytes, "bytes_in_use": used}


def _ratio(a: float, b: float) -> float | None:
    return None if b == 0 else a / b


def run(args: argparse.Namespace) -> int:
    from kvoffload.transfer.sizing import parse_bytes

    sizes = [parse_bytes(s.strip()) for s in str(args.block_sizes).split(",") if s.strip()]
    total = parse_bytes(args.total)
    budget = parse_bytes(args.budget)
    if args.batch < 1 or args.requests_in_flight < 1 or args.repeat < 1:
        raise SystemExit("--batch, --requests-in-flight and --repeat must be positive")
    import logging

    # vLLM logs every tier's creation at INFO: keep the figures readable.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    base_parent = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base_parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="kvoffload-bench-tiers-vllm-", dir=base_parent))
    phases = 4 * len(sizes) * args.repeat + 2
    try:
        with progress_bar("tiers under vLLM", phases, show=not args.json) as advance:
            per_size = [measure_size(base, b, total, args, advance) for b in sizes]
            use = measure_budget(base, budget, args, advance)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result: dict[str, Any] = {
        "benchmark": "tiers-vllm",
        "filesystem_dir": str(base_parent),
        "vllm_fs_io": "C (vllm.fs_io_C)" if fs_io._HAS_FSIO_C else "python",
        "sizes": [],
        "disk_use": use,
    }
    for s in per_size:
        k, v = s.tiers["kvoffload"], s.tiers["vllm_fs"]
        result["sizes"].append(
            {
                "block_bytes": s.block_bytes,
                "blocks": s.blocks,
                "kvoffload": asdict(k),
                "vllm_fs": asdict(v),
                "ratio_write": _ratio(k.write_mb_s, v.write_mb_s),
                "ratio_read": _ratio(k.read_mb_s, v.read_mb_s),
                "ratio_sched_time": _ratio(k.sched_ms_per_step, v.sched_ms_per_step),
                "ratio_sched_per_block": _ratio(k.sched_us_per_block, v.sched_us_per_block),
            }
        )
    used = use["bytes_in_use"]
    result["disk_use"]["ratio_to_budget"] = {
        which: used[which] / use["budget_bytes"] for which in used
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    print(
        "kvoffload disk tier vs vLLM fs tier, both under vLLM's TieringOffloadingManager "
        f"(vLLM fs I/O: {result['vllm_fs_io']}; dir {result['filesystem_dir']}; noisy wall clock)"
    )
    head = (
        f"{'block':>8} {'tier':>10} {'write MB/s':>11} {'read MB/s':>10} "
        f"{'sched ms/step':>14} {'sched us/block':>15} {'lookup ms/step':>15} {'misses':>7}"
    )
    print(head)
    for s in result["sizes"]:
        for which in ("vllm_fs", "kvoffload"):
            f = s[which]
            print(
                f"{s['block_bytes'] >> 10:>6}Ki {which:>10} {f['write_mb_s']:>11.1f} "
                f"{f['read_mb_s']:>10.1f} {f['sched_ms_per_step']:>14.3f} "
                f"{f['sched_us_per_block']:>15.1f} "
                f"{f['lookup_ms_per_step']:>15.3f} {f['read_misses']:>7}"
            )
        print(
            f"{'':>8} {'ratio':>10} {_fmt(s['ratio_write']):>11} {_fmt(s['ratio_read']):>10} "
            f"{_fmt(s['ratio_sched_time']):>14} {_fmt(s['ratio_sched_per_block']):>15}"
        )
    use = result["disk_use"]
    mib = 1 << 20
    print(
        f"disk bytes in use after writing {use['written_bytes'] / mib:.0f} MiB "
        f"(kvoffload budget {use['budget_bytes'] / mib:.0f} MiB):"
    )
    for which, used in use["bytes_in_use"].items():
        print(
            f"  {which:>10}: {used / mib:8.1f} MiB "
            f"({use['ratio_to_budget'][which]:.2f}x the budget)"
        )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main() -> int:  # pragma: no cover - for ``python -m``
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
