"""A Mooncake Store on loopback for tests: a master and segment holders, each a process.

Every process listens and connects on 127.0.0.1 only (``MC_TCP_BIND_ADDRESS``,
``--rpc_address``, ``--metrics_host``, P2PHANDSHAKE metadata: the master is
the only endpoint), and every process started here is stopped by ``close``
(the fixtures call it). Logs go to files under the test's temporary
directory, so a failure can be read there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
#: How long the master keeps a silent holder's segment (the fault tests wait for it).
CLIENT_TTL_S = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found beside {sys.executable} nor on PATH")
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    return env


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout_s}s")


def _stop(proc: subprocess.Popen[bytes] | None, sig_kill: bool = False) -> None:
    if proc is None or proc.poll() is not None:
        return
    if sig_kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class LoopbackMooncake:
    """One master (restartable on the same port) and any number of segment holders."""

    def __init__(
        self, logdir: Path, master_flags: tuple[str, ...] = (), client_ttl_s: int = CLIENT_TTL_S
    ) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.metrics_port = free_port()
        self.master_flags = master_flags
        self.client_ttl_s = client_ttl_s
        self.master: subprocess.Popen[bytes] | None = None
        self.holders: list[subprocess.Popen[bytes]] = []
        self._starts = 0
        self.start_master()

    @property
    def url(self) -> str:
        return f"mooncakestore://{LOOPBACK}:{self.port}"

    @property
    def addr(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start_master(self) -> None:
        self._starts += 1
        log = open(self.logdir / f"master-{self._starts}.log", "wb")  # noqa: SIM115
        self.master = subprocess.Popen(
            [
                _binary("mooncake_master"),
                f"--rpc_port={self.port}",
                f"--rpc_address={LOOPBACK}",
                "--enable_metric_reporting=false",
                f"--metrics_port={self.metrics_port}",
                f"--metrics_host={LOOPBACK}",
                f"--client_ttl={self.client_ttl_s}",
                *self.master_flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        log.close()
        _wait_port(self.port, self.master, "mooncake_master")

    def kill_master(self) -> None:
        _stop(self.master, sig_kill=True)

    def add_holder(self, segment_bytes: int = 64 << 20) -> subprocess.Popen[bytes]:
        """A process that contributes ``segment_bytes`` to the pool (``mooncake_client``)."""
        port = free_port()
        log = open(self.logdir / f"holder-{len(self.holders)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                _binary("mooncake_client"),
                f"--host={LOOPBACK}",
                f"--port={port}",
                f"--global_segment_size={segment_bytes}",
                "--local_buffer_size=0",
                "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={self.addr}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        log.close()
        self.holders.append(proc)
        _wait_port(port, proc, "mooncake_client (segment holder)")
        return proc

    def kill_holder(self, proc: subprocess.Popen[bytes]) -> None:
        _stop(proc, sig_kill=True)

    def close(self) -> None:
        for proc in self.holders:
            _stop(proc)
        _stop(self.master)
