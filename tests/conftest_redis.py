"""A real ``redis-server`` for tests: free loopback port, temp dir, kill and restart.

Import the fixtures into a ``conftest.py`` (``from tests.conftest_redis import
redis_server, redis_server_factory``). Tests using them are skipped, with the
reason, only when no ``redis-server`` (or ``valkey-server``) binary is on PATH.
"""

from __future__ import annotations

import random
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


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for ``bind(0)`` (32768 when it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now on every interface, below the kernel's ephemeral range.

    The caller binds it later (a redis-server, a vLLM engine's KV-event socket),
    and any ``bind(0)`` in between could be handed the same port if it came from
    the ephemeral range: a vLLM engine's own sockets once took the events port
    that way ("Address already in use" at engine start, in CI)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} after 200 tries")


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


# -- Redis Cluster -------------------------------------------------------------------------


def find_cli_binary() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def free_cluster_port() -> int:
    """A port P with P and its cluster bus port P + 10000 both free (P <= 55535)."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterNodes:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback, built with redis-cli.

    Every node runs with a short ``cluster-node-timeout`` (failures are noticed
    in about a second) and, unless ``full_coverage``, ``cluster-require-full-coverage
    no`` (the surviving masters keep serving their slots when one dies, as a
    cache cluster would; with it, the whole cluster answers CLUSTERDOWN).
    """

    def __init__(
        self,
        binary: str,
        cli: str,
        workdir: Path,
        masters: int = 3,
        full_coverage: bool = False,
    ) -> None:
        self.cli = cli
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            d = workdir / f"cluster{i}"
            d.mkdir(parents=True, exist_ok=True)
            node = _ClusterNode(binary, d, port=free_cluster_port())
            node.full_coverage = full_coverage
            self.nodes.append(node)

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{seeds}"

    def start(self) -> RedisClusterNodes:
        for n in self.nodes:
            n.start()
        res = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if res.returncode != 0:
            self.kill()
            raise RuntimeError(f"redis-cli --cluster create failed: {res.stdout}{res.stderr}")
        self.wait_state("ok")
        return self

    def cluster_info(self, node: RedisServer) -> dict[str, str]:
        import redis

        client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2)
        try:
            raw = client.execute_command("CLUSTER INFO")
        finally:
            client.close()
        if isinstance(raw, dict):  # redis-py parses CLUSTER INFO itself
            return {str(k): str(v) for k, v in raw.items()}
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def wait_state(self, state: str, timeout_s: float = 30.0) -> None:
        """Until every running node reports ``cluster_state:<state>``."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [self.cluster_info(n).get("cluster_state") for n in self.nodes if n.running]
            if states and all(s == state for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not reach state {state!r}: {states}")
            time.sleep(0.05)

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()


class _ClusterNode(RedisServer):
    full_coverage = False

    def _args(self) -> list[str]:
        return [
            *super()._args(),
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.workdir / "nodes.conf"),
            "--cluster-node-timeout", "1000",
            "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
        ]  # fmt: skip


class RedisClusterFactory:
    """Starts clusters on demand; every one is killed at teardown."""

    def __init__(self, binary: str, cli: str, tmp_path: Path) -> None:
        self.binary, self.cli, self.tmp_path = binary, cli, tmp_path
        self.clusters: list[RedisClusterNodes] = []

    def __call__(self, masters: int = 3, full_coverage: bool = False) -> RedisClusterNodes:
        workdir = self.tmp_path / f"rc{len(self.clusters)}"
        cluster = RedisClusterNodes(self.binary, self.cli, workdir, masters, full_coverage)
        self.clusters.append(cluster)
        return cluster.start()

    def close(self) -> None:
        for c in self.clusters:
            c.kill()


@pytest.fixture
def redis_cluster_factory(tmp_path: Path) -> Iterator[RedisClusterFactory]:
    """Clusters on demand (skipped without redis-server and redis-cli)."""
    binary, cli = find_server_binary(), find_cli_binary()
    if binary is None or cli is None:
        pytest.skip(
            "Redis Cluster tests need redis-server and redis-cli (apt-get install redis-server "
            "redis-tools)"
        )
    factory = RedisClusterFactory(binary, cli, tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def redis_cluster(redis_cluster_factory: RedisClusterFactory) -> RedisClusterNodes:
    """A fresh 3-master cluster for one test."""
    return redis_cluster_factory()
