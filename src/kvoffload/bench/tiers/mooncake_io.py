"""``kvoffload bench tiers``, Mooncake: the Mooncake tier's store beside the Redis tier's.

Per block size, in the same run as the Redis measurement and on the same
bytes: put / get GB/s and the latency of one 32-key presence check, for

- *remote*: this process a pure client, the bytes held by another process
  (a ``mooncake_client`` contributing its segment): every byte crosses
  loopback TCP, as every Redis byte does;
- *co-located*: this process contributes the segment itself (Mooncake then
  copies in memory).

Blocks move zero-copy: from and into a registered array, a 16-byte header
and the block as two buffers of one object (``MooncakeBlockStore.put_views``
/ ``get_views``), as the tier's handler moves CPU slots: no staging copy.
Without ``--mooncake-url`` a temporary master (and the remote holder) run on
127.0.0.1 for the run; with it, only the remote measurement runs, against
that deployment's holders.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import batches, block_keys, gbps, parse_bytes, timed

LOOPBACK = "127.0.0.1"
#: Keys per presence check, and checks per median.
PRESENCE_KEYS = 32
PRESENCE_CALLS = 50
#: Put / get rounds per point (their median is reported).
ROUNDS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _binary(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(1000):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{proc.args!r} did not listen on {LOOPBACK}:{port}")


def _start(args: list[str], port: int, procs: list[subprocess.Popen[bytes]]) -> None:
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": LOOPBACK}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    procs.append(proc)
    _wait_port(port, proc)


def _master(procs: list[subprocess.Popen[bytes]]) -> str:
    master = _binary("mooncake_master")
    if master is None:
        raise FileNotFoundError("mooncake_master")
    port = _free_port()
    _start(
        [
            master,
            f"--rpc_port={port}",
            f"--rpc_address={LOOPBACK}",
            "--enable_metric_reporting=false",
            f"--metrics_port={_free_port()}",
            f"--metrics_host={LOOPBACK}",
        ],
        port,
        procs,
    )
    return f"{LOOPBACK}:{port}"


@contextlib.contextmanager
def mooncake_masters(
    url: str | None, segment_bytes: int
) -> Iterator[tuple[str | None, str | None, str | None]]:
    """(remote URL, co-located URL, why skipped): temporary masters unless ``url`` is given."""
    if url is not None:
        yield url, None, None
        return
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        yield None, None, f"the Mooncake wheel does not import ({exc})"
        return
    holder = _binary("mooncake_client")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        remote, local = _master(procs), _master(procs)
        if holder is None:
            raise FileNotFoundError("mooncake_client")
        port = _free_port()
        _start(
            [
                holder,
                f"--host={LOOPBACK}",
                f"--port={port}",
                f"--global_segment_size={segment_bytes}",
                "--local_buffer_size=0",
                "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={remote}",
            ],
            port,
            procs,
        )
        yield f"mooncakestore://{remote}", f"mooncakestore://{local}", None
    except FileNotFoundError as exc:
        yield None, None, f"{exc} not found"
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def presence_us(contains_many: Any, keys: list[Any]) -> float:
    """Median microseconds of one ``PRESENCE_KEYS``-key presence check (all present)."""
    probe = keys[:PRESENCE_KEYS]
    times = []
    for _ in range(PRESENCE_CALLS):
        t = time.perf_counter()
        if not all(contains_many(probe)):
            raise RuntimeError("presence check missed stored blocks")
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _measure(
    url: str, segment_bytes: int, block_bytes: int, total: int, batch: int
) -> dict[str, Any]:
    from kvoffload.tiers.mooncake.store import HEADER_BYTES, MooncakeBlockStore

    n = max(PRESENCE_KEYS, total // block_bytes)
    data = np.random.default_rng(1).integers(0, 256, (n, block_bytes), dtype=np.uint8)
    out = np.empty_like(data)
    heads = np.zeros((n, HEADER_BYTES), dtype=np.uint8)
    store = MooncakeBlockStore(url, "bench", block_bytes, segment_bytes=segment_bytes)
    keys = block_keys(n, 5)
    parts = batches(n, batch)
    try:
        for arr in (data, out, heads):
            store.register(arr.ctypes.data, arr.nbytes)
        store.clear()

        def put() -> None:
            for b in parts:
                lo, hi = b.start, b.stop
                if not all(store.put_views(keys[lo:hi], list(data[lo:hi]), list(heads[lo:hi]))):
                    raise RuntimeError("the Mooncake store refused blocks (pool too small?)")

        def get() -> None:
            for b in parts:
                lo, hi = b.start, b.stop
                if not all(store.get_views(keys[lo:hi], list(out[lo:hi]), list(heads[lo:hi]))):
                    raise RuntimeError("the Mooncake store missed blocks (evicted?)")

        puts, gets = [], []
        for _ in range(ROUNDS):  # the median of a few: the machine is shared and noisy
            store.clear()
            puts.append(timed(put))
            out[:] = 0
            gets.append(timed(get))
            if not np.array_equal(out, data):
                raise RuntimeError("Mooncake round trip was not bit-identical")
        t_put, t_get = statistics.median(puts), statistics.median(gets)
        presence = presence_us(store.contains_many, keys)
        store.clear()
    finally:
        store.close()
    return {
        "put_gbps": gbps(n * block_bytes, t_put),
        "get_gbps": gbps(n * block_bytes, t_get),
        "presence_us": presence,
        "blocks": n,
    }


def redis_presence_us(url: str, block_bytes: int) -> float:
    """The Redis tier's presence check (pipelined STRLEN) on the same number of keys."""
    from kvoffload.tiers.redis.store import RedisBlockStore

    store = RedisBlockStore(url, "bench-presence", block_bytes, timeout_s=5.0)
    keys = block_keys(PRESENCE_KEYS, 6)
    try:
        store.put(keys, np.zeros((PRESENCE_KEYS, block_bytes), dtype=np.uint8))
        us = presence_us(store.contains_many, keys)
        store.remove(keys)
    finally:
        store.close()
    return us


def bench_mooncake(
    args: argparse.Namespace, block_bytes: int, remote: str, local: str | None
) -> dict[str, Any]:
    """One block size: remote (and co-located when a temporary master runs) figures."""
    total = parse_bytes(args.total)
    res: dict[str, Any] = {"block_bytes": block_bytes}
    for where, url, seg in (("remote", remote, 0), ("local", local, args.mooncake_segment)):
        if url is None:
            continue
        got = _measure(url, seg, block_bytes, total, args.batch)
        res["blocks"] = got.pop("blocks")
        res.update({f"{where}_{k}": v for k, v in got.items()})
    return res


def add_ratios(row: dict[str, Any], redis: dict[str, Any] | None) -> None:
    """Remote Mooncake against the Redis tier of the same size (>1: Mooncake faster)."""
    if redis is None:
        return
    row["redis_put_gbps"] = redis["put_gbps"]
    row["redis_get_gbps"] = redis["get_gbps"]
    row["redis_presence_us"] = redis.get("presence_us", 0.0)
    row["put_vs_redis"] = row["remote_put_gbps"] / redis["put_gbps"] if redis["put_gbps"] else 0
    row["get_vs_redis"] = row["remote_get_gbps"] / redis["get_gbps"] if redis["get_gbps"] else 0
    mc = row["remote_presence_us"]
    row["presence_vs_redis"] = row["redis_presence_us"] / mc if mc else 0.0


def mooncake_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    from kvoffload.bench.tiers.common import format_bytes

    t = Table(
        title="Mooncake tier vs the Redis tier, same run (GB/s, Mooncake: median of "
        f"{ROUNDS}; presence: us per {PRESENCE_KEYS}-key check, median of {PRESENCE_CALLS}; "
        f"batches of {report['batch']})",
        caption="remote: another process holds the segment (loopback TCP, as Redis); "
        "local: this process holds it. x: remote Mooncake / Redis (presence: Redis / Mooncake)",
    )
    cols = ("block", "put", "get", "pres.", "local put", "local get", "local pres.")
    for col in (*cols, "Redis put", "Redis get", "Redis pres.", "put x", "get x", "pres. x"):
        t.add_column(col, justify="right")
    for r in report["mooncake"]:

        def f(key: str, fmt: str = "{:.2f}", row: dict[str, Any] = r) -> str:
            return fmt.format(row[key]) if key in row else "-"

        t.add_row(
            format_bytes(r["block_bytes"]),
            f("remote_put_gbps"),
            f("remote_get_gbps"),
            f("remote_presence_us", "{:.0f}"),
            f("local_put_gbps"),
            f("local_get_gbps"),
            f("local_presence_us", "{:.0f}"),
            f("redis_put_gbps"),
            f("redis_get_gbps"),
            f("redis_presence_us", "{:.0f}"),
            f("put_vs_redis"),
            f("get_vs_redis"),
            f("presence_vs_redis"),
        )
    return t
