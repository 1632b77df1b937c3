"""``kvoffload bench tiers``: disk and Redis tier throughput against raw I/O of the same bytes.

Per block size, in one run:

- disk: ``DiskBlockStore.put`` / ``get_into`` in batches (checksums, index,
  O_DIRECT where the filesystem allows), against the baseline of writing and
  reading the same bytes as one sequential stream of 16 MiB ``pwrite`` /
  ``pread`` calls in the same I/O mode (the practical limit of the device);
- the disk tier's handler (``DiskTransferHandler``): CPU slots of a real host
  pool to disk and back, for a ``cross_layer`` pool (zero-copy) and a
  ``layer_first`` pool (gathered and scattered through a staging buffer);
- Redis: ``RedisBlockStore.put`` / ``get_into`` (header, checksum, verified
  reads) against plain pipelined ``SET`` / ``MGET`` of the same bytes on the
  same server (a temporary ``redis-server`` when no ``--redis-url`` is given).

Disk writes are timed on a second pass, over slab blocks the first pass
allocated (the steady state of a tier that has filled up once). Buffered disk
reads may come from the page cache; with O_DIRECT (the default where
possible) they do not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.cli import argtypes

_CHUNK = 16 << 20


# The transfer package imports torch: these load it on first use, not for --help.
def aligned_empty(nbytes: int) -> np.ndarray:
    from kvoffload.transfer.block_buffers import aligned_empty as impl

    return impl(nbytes)


def parse_bytes(value: str | int) -> int:
    from kvoffload.transfer.sizing import parse_bytes as impl

    return impl(value)


def format_bytes(num_bytes: int) -> str:
    from kvoffload.transfer.sizing import format_bytes as impl

    return impl(num_bytes)


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
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _batches(n: int, batch: int) -> list[range]:
    return [range(i, min(n, i + batch)) for i in range(0, n, batch)]


def _keys(n: int, salt: int) -> list[bytes]:
    return [(salt << 40 | i).to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]


# -- disk -----------------------------------------------------------------------


def _raw_disk(path: Path, data: np.ndarray, direct: bool) -> tuple[float, float]:
    """Seconds to write then read ``data`` as one sequential stream of big calls."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        os.ftruncate(fd, data.nbytes)
        mv = memoryview(data)

        def write() -> None:
            for off in range(0, data.nbytes, _CHUNK):
                os.pwrite(fd, mv[off : off + _CHUNK], off)

        def read() -> None:
            for off in range(0, data.nbytes, _CHUNK):
                os.preadv(fd, [mv[off : off + _CHUNK]], off)

        write()  # as for the store: time writes over allocated blocks
        return _timed(write), _timed(read)
    finally:
        os.close(fd)
        path.unlink()


def bench_disk(args: argparse.Namespace, block_bytes: int, root: Path) -> dict[str, Any]:
    from kvoffload.tiers.disk.store import DiskBlockStore

    n = max(1, parse_bytes(args.total) // block_bytes)
    data = aligned_empty(n * block_bytes).reshape(n, block_bytes)
    data[:] = np.random.default_rng(0).integers(0, 256, data.shape, dtype=np.uint8)
    out = aligned_empty(n * block_bytes).reshape(n, block_bytes)
    d = root / f"disk-{block_bytes}"
    store = DiskBlockStore(
        d,
        block_bytes,
        n,
        "bench",
        direct_io=False if args.buffered else None,
        num_io_threads=args.io_threads,
    )
    try:
        keys = _keys(n, 1)
        parts = _batches(n, args.batch)

        def put() -> None:
            for b in parts:
                store.put([keys[i] for i in b], data[b.start : b.stop], list(b))

        def get() -> None:
            for b in parts:
                store.get_into([keys[i] for i in b], out[b.start : b.stop])

        put()  # the first pass fills fresh slabs (extent allocation): time the steady state
        t_put, t_get = _timed(put), _timed(get)
        if not np.array_equal(out, data):
            raise RuntimeError("disk round trip was not bit-identical")
        direct = store.direct_io
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)
    t_raw_w, t_raw_r = _raw_disk(root / f"raw-{block_bytes}.bin", data, direct)
    total = n * block_bytes
    res = {
        "block_bytes": block_bytes,
        "blocks": n,
        "direct_io": direct,
        "put_gbps": _gbps(total, t_put),
        "get_gbps": _gbps(total, t_get),
        "raw_write_gbps": _gbps(total, t_raw_w),
        "raw_read_gbps": _gbps(total, t_raw_r),
    }
    res["put_ratio"] = res["put_gbps"] / res["raw_write_gbps"] if res["raw_write_gbps"] else 0.0
    res["get_ratio"] = res["get_gbps"] / res["raw_read_gbps"] if res["raw_read_gbps"] else 0.0
    res.update(bench_disk_handler(args, block_bytes, root))
    return res


def _run_jobs(handler: Any, specs: list[Any]) -> None:
    """Submit every job at once (the handler's threads overlap them), wait, check results."""
    for i, spec in enumerate(specs):
        handler.submit(i, spec)
    handler.wait(range(len(specs)))
    bad = [r for r in handler.get_finished() if not r.success]
    if bad:
        raise RuntimeError(f"disk handler job failed: {bad[0].error}")


def bench_disk_handler(args: argparse.Namespace, block_bytes: int, root: Path) -> dict[str, Any]:
    """CPU slots -> disk -> CPU slots through the handler, zero-copy and staged pools."""
    import torch

    from kvoffload.offload import CPULoadStoreSpec
    from kvoffload.tiers.disk.handler import DiskTransferHandler
    from kvoffload.tiers.disk.store import DiskBlockStore
    from kvoffload.tiers.lower_tier import DiskLoadStoreSpec
    from kvoffload.transfer.host_pool import HostPool
    from kvoffload.transfer.layout import KVGeometry, KVLayout
    from kvoffload.transfer.spec import TransferSpec

    per_token = 2 * 8 * 8 * 128 * 2  # 8 layers, 8 KV heads, head size 128, fp16
    if block_bytes % per_token:
        return {}
    geom = KVGeometry(8, 8, 128, block_bytes // per_token, torch.float16)
    n = max(1, parse_bytes(args.total) // block_bytes)
    res: dict[str, Any] = {}
    for kind in ("cross_layer", "layer_first"):
        pool = HostPool(KVLayout(geom, kind), n, pin_memory=False)
        raw = pool.region.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        before = pool.read_slots(list(range(n)))
        d = root / f"handler-{kind}-{block_bytes}"
        store = DiskBlockStore(
            d,
            pool.slot_bytes,
            n,
            "bench",
            direct_io=False if args.buffered else None,
            num_io_threads=args.io_threads,
        )
        handler = DiskTransferHandler(store, pool)
        keys = _keys(n, 2)
        down_specs = [
            TransferSpec(
                CPULoadStoreSpec(list(b)), DiskLoadStoreSpec(list(b), keys[b.start : b.stop])
            )
            for b in _batches(n, args.batch)
        ]
        up_specs = [TransferSpec(sp.dst, sp.src) for sp in down_specs]
        try:
            down = partial(_run_jobs, handler, down_specs)
            up = partial(_run_jobs, handler, up_specs)
            down()
            t_down = _timed(down)
            raw.zero_()
            t_up = _timed(up)
            if not torch.equal(pool.read_slots(list(range(n))), before):
                raise RuntimeError("disk handler round trip was not bit-identical")
        finally:
            handler.close()
            store.close()
            shutil.rmtree(d, ignore_errors=True)
        res[f"{kind}_down_gbps"] = _gbps(n * pool.slot_bytes, t_down)
        res[f"{kind}_up_gbps"] = _gbps(n * pool.slot_bytes, t_up)
    return res


# -- redis ------------------------------------------------------------------------


@contextlib.contextmanager
def _redis_server(url: str | None) -> Iterator[str | None]:
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvoffload-bench-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        for _ in range(500):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def bench_redis(args: argparse.Namespace, block_bytes: int, url: str) -> dict[str, Any]:
    import redis

    from kvoffload.tiers.redis.store import RedisBlockStore

    n = max(1, parse_bytes(args.total) // block_bytes)
    data = np.random.default_rng(0).integers(0, 256, (n, block_bytes), dtype=np.uint8)
    out = np.empty_like(data)
    store = RedisBlockStore(url, "bench", block_bytes, timeout_s=5.0)
    raw = redis.Redis.from_url(url, socket_timeout=5.0)
    keys = _keys(n, 3)
    parts = _batches(n, args.batch)
    try:
        raw.flushdb()

        def put() -> None:
            for b in parts:
                if not all(store.put([keys[i] for i in b], data[b.start : b.stop])):
                    raise RuntimeError("redis store refused blocks")

        def get() -> None:
            for b in parts:
                if not all(store.get_into([keys[i] for i in b], out[b.start : b.stop])):
                    raise RuntimeError("redis store missed blocks")

        t_put, t_get = _timed(put), _timed(get)
        if not np.array_equal(out, data):
            raise RuntimeError("redis round trip was not bit-identical")
        raw.flushdb()
        raw_keys = [b"raw:" + k for k in keys]

        def raw_put() -> None:
            for b in parts:
                pipe = raw.pipeline(transaction=False)
                for i in b:
                    pipe.set(raw_keys[i], data[i].data)
                pipe.execute()

        def raw_get() -> None:
            for b in parts:
                vals = raw.mget([raw_keys[i] for i in b])
                for i, v in zip(b, vals):
                    out[i] = np.frombuffer(v, dtype=np.uint8)

        t_raw_put, t_raw_get = _timed(raw_put), _timed(raw_get)
        raw.flushdb()
    finally:
        store.close()
        raw.close()
    total = n * block_bytes
    res = {
        "block_bytes": block_bytes,
        "blocks": n,
        "put_gbps": _gbps(total, t_put),
        "get_gbps": _gbps(total, t_get),
        "raw_set_gbps": _gbps(total, t_raw_put),
        "raw_mget_gbps": _gbps(total, t_raw_get),
    }
    res["put_ratio"] = res["put_gbps"] / res["raw_set_gbps"] if res["raw_set_gbps"] else 0.0
    res["get_ratio"] = res["get_gbps"] / res["raw_mget_gbps"] if res["raw_mget_gbps"] else 0.0
    return res


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
    report: dict[str, Any] = {"disk": [], "redis": [], "batch": args.batch}
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
        with _redis_server(args.redis_url) as url:
            report["redis_url"] = url
            if url is None:
                report["redis_skipped"] = "no redis-server binary and no --redis-url"
            else:
                for size in sizes:
                    report["redis"].append(bench_redis(args, size, url))
                    progress()
    return report


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    n_sizes = len(_sizes(args))
    steps = n_sizes * ((not args.skip_disk) + (not args.skip_redis))
    err = Console(stderr=True)
    with Progress(
        TextColumn("tiers"), BarColumn(), MofNCompleteColumn(), console=err, transient=True
    ) as bar:
        task = bar.add_task("points", total=steps)
        report = bench(args, progress=lambda: bar.advance(task))
    if args.json:
        print(json.dumps(report))
        return 0
    console = Console(width=max(Console().width, 120))
    if report["disk"]:
        mode = "O_DIRECT" if report["disk"][0]["direct_io"] else "buffered"
        t = Table(
            title=f"disk tier vs sequential raw I/O of the same bytes (GB/s, {mode}, "
            f"batches of {report['batch']})",
            caption=f"in {report['disk_dir']}; handler: 8 layers x 8 KV heads x 128, fp16 slots",
        )
        cols = ("block", "blocks", "put", "raw write", "put%", "get", "raw read", "get%")
        for col in (*cols, "slots->disk (zero-copy/staged)", "disk->slots (zero-copy/staged)"):
            t.add_column(col, justify="right")
        for r in report["disk"]:
            down = up = "-"
            if "cross_layer_down_gbps" in r:
                down = f"{r['cross_layer_down_gbps']:.2f}/{r['layer_first_down_gbps']:.2f}"
                up = f"{r['cross_layer_up_gbps']:.2f}/{r['layer_first_up_gbps']:.2f}"
            t.add_row(
                format_bytes(r["block_bytes"]),
                f"{r['blocks']:,}",
                f"{r['put_gbps']:.2f}",
                f"{r['raw_write_gbps']:.2f}",
                f"{r['put_ratio']:.0%}",
                f"{r['get_gbps']:.2f}",
                f"{r['raw_read_gbps']:.2f}",
                f"{r['get_ratio']:.0%}",
                down,
                up,
            )
        console.print(t)
    if report["redis"]:
        t = Table(
            title=f"Redis tier vs plain pipelined SET/MGET of the same bytes (GB/s, batches of "
            f"{report['batch']})",
            caption=f"server {report['redis_url']}",
        )
        for col in ("block", "blocks", "put", "raw SET", "put%", "get", "raw MGET", "get%"):
            t.add_column(col, justify="right")
        for r in report["redis"]:
            t.add_row(
                format_bytes(r["block_bytes"]),
                f"{r['blocks']:,}",
                f"{r['put_gbps']:.2f}",
                f"{r['raw_set_gbps']:.2f}",
                f"{r['put_ratio']:.0%}",
                f"{r['get_gbps']:.2f}",
                f"{r['raw_mget_gbps']:.2f}",
                f"{r['get_ratio']:.0%}",
            )
        console.print(t)
    elif "redis_skipped" in report:
        console.print(f"redis: skipped ({report['redis_skipped']})")
    return 0
