"""``kvoffload bench tiers``, disk: the disk tier's store and handler against raw I/O.

``DiskBlockStore.put`` / ``get_into`` in batches against writing and reading the
same bytes as one sequential stream of 16 MiB ``pwrite`` / ``pread`` calls in the
same I/O mode; the disk tier's handler (``DiskTransferHandler``) from CPU slots of a
real host pool, ``cross_layer`` (zero-copy) and ``layer_first`` (staged).
"""

from __future__ import annotations

import argparse
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import (
    aligned_empty,
    batches,
    block_keys,
    gbps,
    io_figures,
    parse_bytes,
    timed,
)

_CHUNK = 16 << 20


def _raw_disk(path: Path, data: np.ndarray, direct: bool) -> tuple[float, float]:
    """Seconds to write then read ``data`` as one sequential stream of big calls."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        os.ftruncate(fd, data.nbytes)
        mv = data.data  # a memoryview of the array's bytes

        def write() -> None:
            for off in range(0, data.nbytes, _CHUNK):
                os.pwrite(fd, mv[off : off + _CHUNK], off)

        def read() -> None:
            for off in range(0, data.nbytes, _CHUNK):
                os.preadv(fd, [mv[off : off + _CHUNK]], off)

        write()  # as for the store: time writes over allocated blocks
        return timed(write), timed(read)
    finally:
        os.close(fd)
        path.unlink()


def _store(args: argparse.Namespace, path: Path, block_bytes: int, n: int) -> Any:
    """A disk store of ``n`` blocks in ``path``, in the I/O mode and threads the flags ask."""
    from kvoffload.tiers.disk.store import DiskBlockStore

    direct = False if args.buffered else None
    return DiskBlockStore(
        path, block_bytes, n, "bench", direct_io=direct, num_io_threads=args.io_threads
    )


def bench_disk(args: argparse.Namespace, block_bytes: int, root: Path) -> dict[str, Any]:
    n = max(1, parse_bytes(args.total) // block_bytes)
    data = aligned_empty(n * block_bytes).reshape(n, block_bytes)
    data[:] = np.random.default_rng(0).integers(0, 256, data.shape, dtype=np.uint8)
    out = aligned_empty(n * block_bytes).reshape(n, block_bytes)
    d = root / f"disk-{block_bytes}"
    store = _store(args, d, block_bytes, n)
    try:
        keys = block_keys(n, 1)
        parts = batches(n, args.batch)

        def put() -> None:
            for b in parts:
                store.put([keys[i] for i in b], data[b.start : b.stop], list(b))

        def get() -> None:
            for b in parts:
                store.get_into([keys[i] for i in b], out[b.start : b.stop])

        put()  # the first pass fills fresh slabs (extent allocation): time the steady state
        t_put, t_get = timed(put), timed(get)
        if not np.array_equal(out, data):
            raise RuntimeError("disk round trip was not bit-identical")
        direct = store.direct_io
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)
    t_raw_w, t_raw_r = _raw_disk(root / f"raw-{block_bytes}.bin", data, direct)
    times = {"put": t_put, "get": t_get, "raw_write": t_raw_w, "raw_read": t_raw_r}
    res = io_figures(block_bytes, n, times, "raw_write", "raw_read")
    res["direct_io"] = direct
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
        assert pool.region is not None  # an open pool has its region
        raw = pool.region.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        before = pool.read_slots(list(range(n)))
        d = root / f"handler-{kind}-{block_bytes}"
        store = _store(args, d, pool.slot_bytes, n)
        handler = DiskTransferHandler(store, pool)
        keys = block_keys(n, 2)
        down_specs = [
            TransferSpec(
                CPULoadStoreSpec(list(b)), DiskLoadStoreSpec(list(b), keys[b.start : b.stop])
            )
            for b in batches(n, args.batch)
        ]
        up_specs = [TransferSpec(sp.dst, sp.src) for sp in down_specs]
        try:
            down = partial(_run_jobs, handler, down_specs)
            up = partial(_run_jobs, handler, up_specs)
            down()
            t_down = timed(down)
            raw.zero_()
            t_up = timed(up)
            if not torch.equal(pool.read_slots(list(range(n))), before):
                raise RuntimeError("disk handler round trip was not bit-identical")
        finally:
            handler.close()
            store.close()
            shutil.rmtree(d, ignore_errors=True)
        res[f"{kind}_down_gbps"] = gbps(n * pool.slot_bytes, t_down)
        res[f"{kind}_up_gbps"] = gbps(n * pool.slot_bytes, t_up)
    return res
