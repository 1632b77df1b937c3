"""``kvoffload bench tiers``, Redis: the Redis tier's store against plain pipelined SET / MGET.

On the same server: a temporary ``redis-server`` when no ``--redis-url`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from kvoffload.bench.tiers.common import batches, block_keys, gbps, parse_bytes, timed


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str | None]:
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
    keys = block_keys(n, 3)
    parts = batches(n, args.batch)
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

        t_put, t_get = timed(put), timed(get)
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
                    out[i] = np.frombuffer(cast(bytes, v), dtype=np.uint8)

        t_raw_put, t_raw_get = timed(raw_put), timed(raw_get)
        raw.flushdb()
    finally:
        store.close()
        raw.close()
    total = n * block_bytes
    res = {
        "block_bytes": block_bytes,
        "blocks": n,
        "put_gbps": gbps(total, t_put),
        "get_gbps": gbps(total, t_get),
        "raw_set_gbps": gbps(total, t_raw_put),
        "raw_mget_gbps": gbps(total, t_raw_get),
    }
    res["put_ratio"] = res["put_gbps"] / res["raw_set_gbps"] if res["raw_set_gbps"] else 0.0
    res["get_ratio"] = res["get_gbps"] / res["raw_mget_gbps"] if res["raw_mget_gbps"] else 0.0
    return res
