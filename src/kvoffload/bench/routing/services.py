"""The network services the routing bench needs: a Redis server and Dynamo's indexer.

On one machine the bench starts both itself (:class:`LocalRedis`,
``route_indexer.DynamoIndexer``); with instances on other hosts they are
given by URL (``--redis-url``, ``--indexer-url``) and nothing here runs.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvoffload.bench.routing.indexer import end_process, free_port

START_TIMEOUT_S = 10.0


def _ping(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def flush_redis(url: str) -> None:
    """Empty the shared tier, so each router starts from the same (empty) Redis."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()


class LocalRedis:
    """A ``redis-server`` on loopback, no persistence; ``url`` once started."""

    def __init__(self, binary: str = "redis-server", port: int | None = None) -> None:
        found = shutil.which(binary)
        if found is None:
            raise RuntimeError(
                f"{binary!r} not found: install redis-server, or give --redis-url of a running one"
            )
        self.binary = found
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="kvoffload-route-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir]
        args += ["--save", "", "--appendonly", "no"]
        args += ["--logfile", str(Path(self._dir) / "redis.log")]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(self.url):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            end_process(proc)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
