"""A real ``redis-server`` for tests: free loopback port, temp dir, kill and restart.

Import the fixtures into a ``conftest.py`` (``from tests.conftest_redis import
redis_server, redis_server_factory``). Tests using them are skipped, with the
reason, only when no ``redis-server`` (or ``valkey-server``) binary is on PATH.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_START_TIMEOUT_S = 15.0


def find_server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``, no persistence, logs in ``workdir``."""

    def __init__(
        self,
        binary: str,
        workdir: Path,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        port: int | None = None,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.workdir / f"redis-{self.port}.log"),
        ]  # fmt: skip
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory]
        if self.maxmemory_policy is not None:
            args += ["--maxmemory-policy", self.maxmemory_policy]
        return args

    def start(self) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _ping(self.port):
            if self.proc.poll() is not None:
                log = self.workdir / f"redis-{self.port}.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as in a crash."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> RedisServer:
        """Kill, then start again on the same port (empty: nothing is persisted)."""
        self.kill()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def info(self, section: str = "memory") -> dict[str, object]:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            return dict(client.info(section))
        finally:
            client.close()


class RedisServerFactory:
    """Starts servers on demand; every one is killed at teardown."""

    def __init__(self, binary: str, tmp_path: Path) -> None:
        self.binary = binary
        self.tmp_path = tmp_path
        self.servers: list[RedisServer] = []

    def __call__(
        self, maxmemory: str | None = None, maxmemory_policy: str | None = None
    ) -> RedisServer:
        workdir = self.tmp_path / f"redis{len(self.servers)}"
        workdir.mkdir(parents=True, exist_ok=True)
        server = RedisServer(self.binary, workdir, maxmemory, maxmemory_policy)
        self.servers.append(server)
        return server.start()

    def close(self) -> None:
        for s in self.servers:
            s.kill()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[RedisServerFactory]:
    binary = find_server_binary()
    if binary is None:
        pytest.skip(
            "no redis-server (or valkey-server) binary on PATH; apt-get install redis-server"
        )
    factory = RedisServerFactory(binary, tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def redis_server(redis_server_factory: RedisServerFactory) -> RedisServer:
    """A fresh server for one test."""
    return redis_server_factory()
