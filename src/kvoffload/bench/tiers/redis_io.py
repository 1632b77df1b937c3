"""``kvoffload bench tiers``, Redis: the Redis tier's store against plain pipelined SET / MGET.

On the same server: a temporary ``redis-server`` when no ``--redis-url`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from kvoffload.bench.routing.services import LocalRedis
from kvoffload.bench.tiers.common import batches, block_keys, io_figures, parse_bytes, timed


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str | None]:
    """``url``, else a temporary ``redis-server``'s (or Valkey's), else None (neither found)."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        yield None
        return
    with LocalRedis(binary) as server:
        yield server.url


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
    times = {"put": t_put, "get": t_get, "raw_set": t_raw_put, "raw_mget": t_raw_get}
    return io_figures(block_bytes, n, times, "raw_set", "raw_mget")
