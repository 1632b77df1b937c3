"""A client (and, on one machine, a launcher) for NVIDIA Dynamo's standalone KV indexer.

Dynamo's indexer (PyPI ``ai-dynamo-runtime``, ``python -m dynamo.indexer``) is a plain
HTTP service: ``/register`` subscribes it to an instance's KV events, ``/query`` answers
per instance id the staged overlap ``gpu <= cpu <= disk`` in tokens (absent: nothing
held), ``/dump`` lists the indexed blocks; what 1.6.1 indexes and what it does not:
docs/routing.md. Nothing here is local to one host but :class:`DynamoIndexer`'s launcher:
a router elsewhere uses :class:`IndexerClient` with the service's URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DYNAMO_PACKAGE = "ai-dynamo-runtime==1.6.1"


@dataclass(frozen=True)
class TierOverlap:
    """One instance's answer to a query, in tokens (``gpu <= cpu <= disk``)."""

    longest_matched: int = 0
    gpu: int = 0
    cpu: int = 0
    disk: int = 0

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> TierOverlap:
        def num(name: str) -> int:
            value = obj.get(name, 0)
            return int(value) if isinstance(value, (int, float)) else 0

        return cls(num("longest_matched"), num("gpu"), num("cpu"), num("disk"))


class IndexerError(RuntimeError):
    """The indexer did not answer, or answered something this client cannot read."""


class IndexerClient:
    """Talks to one Dynamo indexer over HTTP at ``url`` (e.g. ``http://10.0.0.5:8090``)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict[str, object] | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"content-type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:200]
            raise IndexerError(f"indexer {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise IndexerError(f"indexer at {self.url} unreachable: {exc}") from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise IndexerError(f"indexer {path}: not JSON: {raw[:200]!r}") from None

    def register(
        self,
        instance_id: int,
        endpoint: str,
        replay_endpoint: str | None,
        model_name: str,
        block_size: int,
    ) -> None:
        """Subscribe the indexer to one instance's KV-event stream (and replay socket)."""
        body: dict[str, object] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model_name,
            "block_size": block_size,
        }
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        self._call("/register", body)

    def query(self, token_ids: Sequence[int], model_name: str) -> dict[int, TierOverlap]:
        """Per instance id, how much of ``token_ids`` each tier holds (absent: nothing)."""
        answer = self._call("/query", {"token_ids": list(token_ids), "model_name": model_name})
        if not isinstance(answer, dict):
            raise IndexerError(f"indexer /query: unexpected answer {answer!r:.200}")
        instances = answer.get("instances") or {}
        if not isinstance(instances, dict):
            raise IndexerError(f"indexer /query: unexpected instances {instances!r:.200}")
        return {int(k): TierOverlap.from_json(v) for k, v in instances.items()}

    def dump(self) -> dict[str, object]:
        answer = self._call("/dump")
        return answer if isinstance(answer, dict) else {}

    def ready(self) -> bool:
        try:
            self._call("/workers")
        except IndexerError:
            return False
        return True


def dynamo_installed() -> bool:
    """True when ``python -m dynamo.indexer`` can run in this interpreter's environment."""
    import importlib.util

    try:
        return importlib.util.find_spec("dynamo.indexer") is not None
    except (ImportError, ValueError):
        return False


def free_port() -> int:
    """A TCP port free now, below the kernel's ephemeral range.

    The caller binds it later; a port from the ephemeral range could be handed
    to some other socket's ``bind(0)`` in between.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise OSError("no free TCP port below the ephemeral range")


def end_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Terminate ``proc``, killed if it outlives ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


class DynamoIndexer:
    """Runs ``python -m dynamo.indexer`` on this host; ``client`` talks to it.

    The process is started by ``start()`` and ended by ``stop()`` (also on
    ``with`` exit). Its log goes to ``log_path`` (default: a file in the
    current temp dir) so a failure can be explained. A restart keeps the port:
    registered instances are forgotten and must be registered again, and then
    the indexer recovers their state through their replay sockets.
    """

    def __init__(
        self,
        port: int | None = None,
        threads: int = 1,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.port = port or free_port()
        self.threads = threads
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/dynamo-indexer-{self.port}.log")
        self.start_timeout_s = start_timeout_s
        self.client = IndexerClient(f"http://127.0.0.1:{self.port}")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DynamoIndexer:
        if self._proc is not None:
            raise RuntimeError("indexer already running")
        if not dynamo_installed():
            raise IndexerError(f"Dynamo's indexer is not installed: pip install '{DYNAMO_PACKAGE}'")
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it open
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dynamo.indexer",
                    "--port",
                    str(self.port),
                    "--threads",
                    str(self.threads),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1"},
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.client.ready():
            if self._proc.poll() is not None:
                self._proc = None
                raise IndexerError(f"Dynamo's indexer exited at start; log: {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise IndexerError(f"Dynamo's indexer did not answer in {self.start_timeout_s}s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            end_process(proc)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_lines(self, contains: str) -> list[str]:
        """Lines of the indexer's log that contain ``contains`` (warnings it gave)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if contains in line]

    def __enter__(self) -> DynamoIndexer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
