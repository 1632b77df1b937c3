"""A CPU -> GPU load job that fails, under vLLM 0.33's two load-failure policies.

``KVOffloadConnector`` reports a failed load to vLLM as finished and hands its
GPU block ids to vLLM's recovery (``get_block_ids_with_load_errors``). These
tests make one real load job fail in kvoffload's transfer worker (its source
slots are out of range, so nothing is copied) after filling its GPU blocks
with garbage, as a half-done copy would, and check what vLLM was told and
what it did:

* vLLM was told exactly the failed job's GPU blocks, once;
* ``recompute``: the request is served, and every block of its prompt holds
  its own KV (the pattern the fake model writes for that block's hash) by the
  time its first token is sampled: the failed blocks were recomputed before
  use, not read as garbage;
* ``fail``: that request ends in an error, the engine goes on.

Either way nothing leaks and the prefix is still served afterwards. Every load
path is covered: asynchronous (the request waits for its load), synchronous
(the load runs inside the step the hit is found, the request with it; vLLM
rolls the running request back) and staged (a synchronous load copied layer by
layer under the forward pass, ``layer_loads``): there the job dies midway, its
second layer's copy raising after the first layer's bytes are in, so the
forward pass has already read the loaded layer when the failure is known.
"""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from kvoffload.offload import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM  # noqa: E402
from tests.integrations.test_vllm_engine import (  # noqa: E402
    PROMPT,
    PROMPT_BLOCKS,
    assert_no_leaks,
    flood,
)
from tests.integrations.vllm_rig import BLOCK_SIZE, VLLMRig, pattern  # noqa: E402


class FailOneLoad:
    """Makes the next CPU -> GPU load submitted to kvoffload's transfer worker fail.

    Its GPU blocks get garbage first (what a copy that died midway leaves), and
    the job is submitted with source slots no host pool has, so the worker
    rejects it and copies nothing.
    """

    def __init__(self, rig: VLLMRig) -> None:
        self.rig = rig
        self.worker = rig.kv_worker.worker
        self.real_submit = self.worker.submit_load
        self.armed = False
        self.job_id: int | None = None
        self.gpu_blocks: list[int] = []
        self.stages_run = 0  # a staged load's stages that ran before the failure
        self.worker.submit_load = self.submit_load  # type: ignore[method-assign]

    def submit_load(
        self, job_id: int, spec: Any, expedited: bool = False, stages: Any = None
    ) -> None:
        src, dst = spec
        if self.armed and isinstance(src, CPULoadStoreSpec) and isinstance(dst, GPULoadStoreSpec):
            self.armed = False
            self.job_id = job_id
            self.gpu_blocks = [int(b) for b in dst.block_ids]
            gen = torch.Generator().manual_seed(job_id)
            for plane in self.rig._planes():
                for b in self.gpu_blocks:
                    row = plane[b]
                    row.copy_(torch.randint(0, 256, row.shape, dtype=torch.uint8, generator=gen))
            if stages is not None:
                self._fail_second_stage()
            else:
                src = CPULoadStoreSpec(np.full(len(src.block_ids), 1 << 30, dtype=np.int64))
        self.real_submit(job_id, (src, dst), expedited, stages)

    def _fail_second_stage(self) -> None:
        handler = self.worker.handlers[(CPU_MEDIUM, GPU_MEDIUM)]
        real = handler.prepare_staged

        def prepare_staged(job_id: int, spec: Any, stages: Any) -> list[Any]:
            handler.prepare_staged = real  # only this job
            parts = real(job_id, spec, stages)

            def first() -> int:
                self.stages_run += 1
                return parts[0]()

            def second() -> int:
                raise OSError("injected: the second layer's copy died")

            return [first, second, *parts[2:]]

        handler.prepare_staged = prepare_staged


def _holds_its_own_kv(rig: VLLMRig, block_id: int, block_hash: bytes) -> bool:
    for p, plane in enumerate(rig._planes()):
        row = plane[block_id]
        if not np.array_equal(row.numpy(), pattern(block_hash, p, row.numel()).view(np.uint8)):
            return False
    return True


@pytest.mark.parametrize("loads", ["async", "sync", "staged"])
@pytest.mark.parametrize("scheduler_cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_goes_to_vllms_recovery_with_its_gpu_blocks(
    tmp_path: Path, policy: str, scheduler_cls: type[Scheduler], loads: str
) -> None:
    budget = {"async": 0, "sync": 1 << 20, "staged": 1 << 20}[loads]
    if loads != "async" and policy == "recompute" and scheduler_cls is AsyncScheduler:
        # vLLM 0.33 rolls the running request back but never releases the output
        # placeholder of the step it skipped: the request hangs. kvoffload's default
        # budget is 0 under async scheduling for this reason.
        pytest.xfail("vLLM 0.33: a failed synchronous load under async scheduling hangs")
    rig = VLLMRig.build(
        tmp_path,
        extra_config={"cpu_bytes": "1MiB", "sync_load_budget_bytes": budget},
        scheduler_cls=scheduler_cls,
        recompute_failed_loads=policy == "recompute",
    )
    rig.forward_layers = loads == "staged"  # its forward passes arm staging
    rig.kv_worker.stage_loads = True  # armed, a load is staged whatever the machine's cores
    rig.add(PROMPT, req_id="first")
    rig.run()
    flood(rig)  # PROMPT's blocks now only in the CPU tier
    stages = rig.kv_worker.layer_stages
    assert (stages is not None and stages.armed) == (loads == "staged")

    wc = rig.worker_connector
    assert wc is not None
    told: list[set[int]] = []
    real_errors = wc.get_block_ids_with_load_errors

    def errors() -> set[int]:
        got = real_errors()
        if got:
            told.append(set(got))
        return got

    wc.get_block_ids_with_load_errors = errors  # type: ignore[method-assign]
    fault = FailOneLoad(rig)
    fault.armed = True

    # Step by hand, checking the prompt's KV when its first token is sampled.
    prompt = [*PROMPT, 5, 6]
    rig.add(prompt, req_id="again")
    checked: list[bool] = []
    for _ in range(200):
        if not rig.scheduler.has_requests() and not rig._transfers_in_flight():
            break
        output = rig.step()
        request = rig.scheduler.requests.get("again")
        if request is not None and request.output_token_ids and not checked:
            (block_ids,) = rig.scheduler.kv_cache_manager.get_block_ids("again")
            checked = [
                _holds_its_own_kv(rig, block_ids[i], bytes(request.block_hashes[i]))
                for i in range(len(prompt) // BLOCK_SIZE)
            ]
        if not output.total_num_scheduled_tokens:
            assert rig.kv_worker.wait_all(timeout=60), "transfers stuck for 60 s"
    else:
        raise AssertionError("engine still busy after 200 steps")

    assert fault.job_id is not None, "no CPU -> GPU load was started"
    assert (fault.job_id in rig.sync_loads) == (loads != "async")
    assert fault.stages_run == (loads == "staged")  # staged: died after its first layer
    assert len(fault.gpu_blocks) == PROMPT_BLOCKS
    assert rig.kv_worker.failed_jobs == 1
    # vLLM was told exactly the failed job's GPU blocks, in one report.
    assert told == [set(fault.gpu_blocks)]
    reasons = rig.finish_reasons()
    if policy == "recompute":
        assert "error" not in reasons["again"].lower()
        # Every prompt block held its own KV when the first token was sampled:
        # the failed blocks were recomputed, not used as loaded.
        assert checked and all(checked), checked
    else:
        assert "error" in reasons["again"].lower()
    assert rig.mismatches == []  # no successful load delivered wrong bytes
    assert_no_leaks(rig)

    # The prefix is still served next time (recompute: from the GPU blocks it
    # recomputed; fail: vLLM evicted those, and the CPU copies load and verify).
    rig.add([*PROMPT, 9], req_id="later")
    rig.run()
    assert rig.first_computed["later"] == len(PROMPT)
    assert rig.mismatches == [] and rig.kv_worker.failed_jobs == 1
    assert_no_leaks(rig)
    rig.shutdown()
