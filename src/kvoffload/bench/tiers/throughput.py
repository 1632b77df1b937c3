"""``kvoffload bench tiers``: disk and Redis tier throughput against raw I/O of the same bytes.

Per block size, in one run: the disk store and the disk tier's handler against sequential
``pwrite`` / ``pread`` (``disk_io``), the Redis store against plain pipelined ``SET`` /
``MGET`` on the same server (``redis_io``), and the Mooncake tier's store, remote and
co-located, beside the Redis figures with ratios (``mooncake_io``). Disk writes are timed
on a second pass, over slabs the first pass allocated (a tier that has filled up once);
buffered disk reads may come from the page cache, O_DIRECT ones (the default) do not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.bench.console import console, progress_bar, table
from kvoffload.bench.tiers.common import format_bytes, parse_bytes
from kvoffload.bench.tiers.disk_io import bench_disk
from kvoffload.bench.tiers.mooncake_io import (
    add_ratios,
    bench_mooncake,
    mooncake_masters,
    mooncake_table,
    redis_presence_us,
)
from kvoffload.bench.tiers.redis_io import bench_redis, redis_server
from kvoffload.cli import argtypes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-sizes",
        type=argtypes.byte_size_list(1 << 30),
        default="64KiB,256KiB,1MiB,4MiB",
        help="comma-separated block sizes (default: %(default)s)",
    )
    parser.add_argument(
        "--total",
        type=argtypes.byte_size(1 << 40),
        default="256MiB",
        help="bytes moved per measurement (default: %(default)s)",
    )
    parser.add_argument(
        "--batch",
        type=argtypes.positive_int(1 << 20),
        default=32,
        help="blocks per put/get call (default: %(default)s)",
    )
    parser.add_argument(
        "--disk-dir",
        type=argtypes.output_dir,
        default=None,
        help="directory to benchmark in (default: a temp dir)",
    )
    parser.add_argument(
        "--buffered", action="store_true", help="buffered disk I/O instead of O_DIRECT"
    )
    parser.add_argument(
        "--io-threads", type=argtypes.positive_int(256), default=4, help="disk store I/O threads"
    )
    parser.add_argument(
        "--redis-url",
        type=argtypes.redis_url,
        default=None,
        help="Redis/Valkey to benchmark (default: start a temporary redis-server)",
    )
    parser.add_argument(
        "--mooncake-url",
        default=None,
        help="mooncakestore://HOST:PORT to benchmark (default: temporary masters and a "
        "holder on 127.0.0.1, remote and co-located)",
    )
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--skip-mooncake", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- driver ---------------------------------------------------------------------------


def _sizes(args: argparse.Namespace) -> list[int]:
    if isinstance(args.block_sizes, list):
        return args.block_sizes
    sizes = [parse_bytes(s) for s in args.block_sizes.split(",") if s.strip()]
    if not sizes:
        raise ValueError(f"bad --block-sizes {args.block_sizes!r}")
    return sizes


def bench(args: argparse.Namespace, progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    sizes = _sizes(args)
    total = parse_bytes(args.total)
    # Each measurement holds the data and a read-back copy in memory; refuse before allocating.
    argtypes.check_fits_in_memory(
        f"--total {format_bytes(total)} (data + read-back copy)",
        2 * max(total, max(sizes)),
    )
    report: dict[str, Any] = {"disk": [], "redis": [], "mooncake": [], "batch": args.batch}
    if not args.skip_disk:
        root = (
            Path(args.disk_dir)
            if args.disk_dir
            else Path(tempfile.mkdtemp(prefix="kvoffload-bench-"))
        )
        root.mkdir(parents=True, exist_ok=True)
        report["disk_dir"] = str(root)
        try:
            for size in sizes:
                report["disk"].append(bench_disk(args, size, root))
                progress()
        finally:
            if not args.disk_dir:
                shutil.rmtree(root, ignore_errors=True)
    if not args.skip_redis:
        if args.redis_url:
            from kvoffload.cli.preflight import check_redis_reachable

            check_redis_reachable(args.redis_url)  # one clear line, not a client traceback
        with redis_server(args.redis_url) as url:
            report["redis_url"] = url
            if url is None:
                report["redis_skipped"] = "no redis-server binary and no --redis-url"
            else:
                for size in sizes:
                    report["redis"].append(bench_redis(args, size, url))
                    report["redis"][-1]["presence_us"] = redis_presence_us(url, size)
                    progress()
    if not args.skip_mooncake:
        _bench_mooncake(args, sizes, total, report, progress)
    return report


def _bench_mooncake(
    args: argparse.Namespace,
    sizes: list[int],
    total: int,
    report: dict[str, Any],
    progress: Callable[[], None],
) -> None:
    # The pool holds one size's blocks at a time (each measurement clears its own).
    args.mooncake_segment = max(16 << 20, total + total // 2 + max(sizes) * 64)
    with mooncake_masters(args.mooncake_url, args.mooncake_segment) as (remote, local, why):
        if remote is None:
            report["mooncake_skipped"] = why
            return
        report["mooncake_url"] = remote
        redis_rows = {r["block_bytes"]: r for r in report["redis"]}
        for size in sizes:
            row = bench_mooncake(args, size, remote, local)
            add_ratios(row, redis_rows.get(size))
            report["mooncake"].append(row)
            progress()


def _disk_table(report: dict[str, Any]) -> Any:
    mode = "O_DIRECT" if report["disk"][0]["direct_io"] else "buffered"
    cols = ("block", "blocks", "put", "raw write", "put%", "get", "raw read", "get%")
    rows = []
    for r in report["disk"]:
        down = up = "-"
        if "cross_layer_down_gbps" in r:
            down = f"{r['cross_layer_down_gbps']:.2f}/{r['layer_first_down_gbps']:.2f}"
            up = f"{r['cross_layer_up_gbps']:.2f}/{r['layer_first_up_gbps']:.2f}"
        rows.append((*_io_cells(r, "raw_write_gbps", "raw_read_gbps"), down, up))
    return table(
        f"disk tier vs sequential raw I/O of the same bytes (GB/s, {mode}, "
        f"batches of {report['batch']})",
        (*cols, "slots->disk (zero-copy/staged)", "disk->slots (zero-copy/staged)"),
        rows,
        caption=f"in {report['disk_dir']}; handler: 8 layers x 8 KV heads x 128, fp16 slots",
    )


def _io_cells(r: dict[str, Any], raw_put: str, raw_get: str) -> list[str]:
    """Block size, blocks, then put and get each beside its raw baseline and their ratio."""
    cells = [format_bytes(r["block_bytes"]), f"{r['blocks']:,}"]
    for op, raw in (("put", raw_put), ("get", raw_get)):
        cells += [f"{r[f'{op}_gbps']:.2f}", f"{r[raw]:.2f}", f"{r[f'{op}_ratio']:.0%}"]
    return cells


def _redis_table(report: dict[str, Any]) -> Any:
    return table(
        f"Redis tier vs plain pipelined SET/MGET of the same bytes (GB/s, batches of "
        f"{report['batch']})",
        ("block", "blocks", "put", "raw SET", "put%", "get", "raw MGET", "get%"),
        [_io_cells(r, "raw_set_gbps", "raw_mget_gbps") for r in report["redis"]],
        caption=f"server {report['redis_url']}",
    )


def run(args: argparse.Namespace) -> int:
    n_sizes = len(_sizes(args))
    steps = n_sizes * ((not args.skip_disk) + (not args.skip_redis) + (not args.skip_mooncake))
    with progress_bar("tiers", steps) as advance:
        report = bench(args, progress=advance)
    if args.json:
        print(json.dumps(report))
        return 0
    out = console(120)
    if report["disk"]:
        out.print(_disk_table(report))
    if report["redis"]:
        out.print(_redis_table(report))
    elif "redis_skipped" in report:
        out.print(f"redis: skipped ({report['redis_skipped']})")
    if report["mooncake"]:
        out.print(mooncake_table(report))
    elif "mooncake_skipped" in report:
        out.print(f"mooncake: skipped ({report['mooncake_skipped']})")
    return 0
