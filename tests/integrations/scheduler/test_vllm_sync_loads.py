"""A CPU-tier hit computed in the engine step it is found, counted through vLLM's scheduler.

``KVOffloadConnector`` loads a hit that fits ``sync_load_budget_bytes``
inside the step: vLLM's scheduler schedules the request at once and the
worker finishes the load before the forward pass. vLLM 0.33 does it natively
("native"); the path kvoffload adds for vLLM 0.32, which has none
("emulated"), runs here on 0.33 with vLLM's own turned off. No timing: steps
are counted, bytes are checked against what the fake model wrote.
"""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadConnector  # noqa: E402
from kvoffload.integrations.vllm.scheduler.sync_loads import DEFAULT_SYNC_LOAD_BUDGET_BYTES  # noqa: E402
from tests.integrations.test_vllm_engine import (  # noqa: E402
    PROMPT,
    PROMPT_BLOCKS,
    assert_no_leaks,
    flood,
)
from tests.integrations.test_vllm_load_failure import FailOneLoad  # noqa: E402
from tests.integrations.vllm_rig import BLOCK_SIZE, VLLMRig  # noqa: E402

BYTES_PER_TOKEN = 2 * 2048 // BLOCK_SIZE  # two layers of 2,048-byte pages per 16 tokens
HIT_BYTES = len(PROMPT) * BYTES_PER_TOKEN  # what a hit on PROMPT loads
OTHER = [500 + t for t in PROMPT]  # a second prefix of the same length


def _rig(tmp_path: Path, path: str, budget: int | None, **kwargs: object) -> VLLMRig:
    """``budget`` None: the connector's default (the rig runs without async scheduling)."""
    extra: dict[str, object] = {"cpu_bytes": "1MiB"}
    if budget is not None and path == "native":
        extra["sync_load_budget_bytes"] = budget
    kwargs.setdefault("async_scheduling", False)
    rig = VLLMRig.build(tmp_path, extra_config=extra, **kwargs)  # type: ignore[arg-type]
    connector = rig.scheduler.connector
    assert isinstance(connector, KVOffloadConnector)
    if path == "emulated":
        connector.emulate_sync_loads(
            DEFAULT_SYNC_LOAD_BUDGET_BYTES if budget is None else budget,
            rig.scheduler.kv_cache_config,
        )
    return rig


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_default_budget_is_on_without_async_scheduling(
    tmp_path: Path, async_scheduling: bool
) -> None:
    rig = _rig(tmp_path, "native", budget=None, async_scheduling=async_scheduling)
    connector = rig.scheduler.connector
    assert isinstance(connector, KVOffloadConnector) and connector.connector_scheduler
    # Under async scheduling vLLM 0.33 hangs a request whose synchronous load failed.
    want = 0 if async_scheduling else DEFAULT_SYNC_LOAD_BUDGET_BYTES
    assert connector.connector_scheduler.config.sync_load_budget_bytes == want
    rig.shutdown()


def _spy_expedited(rig: VLLMRig) -> list[bool]:
    """Records, per load the worker submits from now on, whether it came expedited."""
    worker = rig.kv_worker.worker
    real = worker.submit_load
    seen: list[bool] = []

    def spy(job_id: int, spec: object, expedited: bool = False, stages: object = None) -> None:
        seen.append(expedited)
        real(job_id, spec, expedited, stages)  # type: ignore[arg-type]

    worker.submit_load = spy  # type: ignore[method-assign]
    return seen


def _steps_until_scheduled(rig: VLLMRig, req_id: str, limit: int = 50) -> int:
    """Engine steps from the request's arrival to the step that computes it (1: the first)."""
    for n in range(1, limit + 1):
        output = rig.step()
        if any(r.req_id == req_id for r in output.scheduled_new_reqs):
            return n
        if not output.total_num_scheduled_tokens:
            assert rig.kv_worker.wait_all(timeout=60), "transfers stuck for 60 s"
    raise AssertionError(f"{req_id} not scheduled in {limit} steps")


def _evicted(rig: VLLMRig, *prompts: list[int]) -> None:
    """Serve ``prompts`` and push them out of the GPU tier: only the CPU tier holds them."""
    for i, prompt in enumerate(prompts):
        rig.add(prompt, req_id=f"seed{i}")
    rig.run()
    flood(rig)


def _served_from_cpu_tier(rig: VLLMRig, req_id: str) -> None:
    rig.run()
    assert rig.first_computed[req_id] == len(PROMPT)
    assert rig.mismatches == [] and rig.late_sync_loads == []
    assert_no_leaks(rig)


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_a_hit_under_the_budget_is_computed_in_the_step_it_is_found(
    tmp_path: Path, path: str
) -> None:
    rig = _rig(tmp_path, path, budget=None)  # the connector's default budget
    _evicted(rig, PROMPT)
    # A new full block after the hit: the step that loads also offers a store
    # (vLLM 0.32 asserts no load is pending then; kvoffload's sync load is).
    rig.add([*PROMPT, *range(200, 218)], req_id="again")
    expedited = _spy_expedited(rig)
    assert _steps_until_scheduled(rig, "again") == 1
    assert len(rig.sync_loads) == 1  # one load, finished before the step's forward pass
    # Expedited: run whole by the waiting engine thread, not queued on the pool.
    assert expedited == [True]
    _served_from_cpu_tier(rig, "again")
    assert rig.blocks_verified == PROMPT_BLOCKS
    rig.shutdown()


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_a_hit_over_the_budget_stays_asynchronous_and_correct(tmp_path: Path, path: str) -> None:
    rig = _rig(tmp_path, path, budget=HIT_BYTES - 1)
    _evicted(rig, PROMPT)
    rig.add([*PROMPT, 5, 6], req_id="again")
    expedited = _spy_expedited(rig)
    rig.step()
    assert rig.scheduler.requests["again"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert rig.sync_loads == []
    assert expedited == [False]
    _served_from_cpu_tier(rig, "again")
    assert rig.blocks_verified == PROMPT_BLOCKS
    rig.shutdown()


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_the_budget_is_per_step_the_hit_that_does_not_fit_waits(tmp_path: Path, path: str) -> None:
    # Room for one hit per step; GPU room for both requests at once.
    rig = _rig(tmp_path, path, budget=HIT_BYTES, num_gpu_blocks=16)
    _evicted(rig, PROMPT, OTHER)
    flood(rig, 4)
    synced, verified = len(rig.sync_loads), rig.blocks_verified
    rig.add([*PROMPT, 5, 6], req_id="a")
    rig.add([*OTHER, 5, 6], req_id="b")
    output = rig.step()
    assert {r.req_id for r in output.scheduled_new_reqs} == {"a"}
    assert rig.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(rig.sync_loads) == synced + 1
    rig.run()
    assert (rig.first_computed["a"], rig.first_computed["b"]) == (len(PROMPT), len(OTHER))
    assert rig.mismatches == [] and rig.late_sync_loads == []
    assert rig.blocks_verified == verified + 2 * PROMPT_BLOCKS
    assert_no_leaks(rig)
    rig.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_emulated_sync_load_is_a_miss_and_a_recompute(tmp_path: Path, policy: str) -> None:
    rig = _rig(tmp_path, "emulated", budget=None, recompute_failed_loads=policy == "recompute")
    _evicted(rig, PROMPT)
    fault = FailOneLoad(rig)
    fault.armed = True
    rig.add([*PROMPT, 5, 6], req_id="again")
    assert _steps_until_scheduled(rig, "again") == 1
    rig.run()
    assert fault.job_id in rig.sync_loads and rig.kv_worker.failed_jobs == 1
    finished = rig.finish_reasons()
    assert ("error" in finished["again"].lower()) == (policy == "fail")
    assert rig.mismatches == [] and rig.late_sync_loads == []
    assert_no_leaks(rig)
    # The prefix is still served (recomputed blocks in the GPU tier, or the CPU copy).
    rig.add([*PROMPT, 9], req_id="later")
    rig.run()
    assert rig.first_computed["later"] == len(PROMPT) and rig.mismatches == []
    assert_no_leaks(rig)
    rig.shutdown()
