"""Queue and session hints from vLLM 0.33's real Scheduler through the kvoffload plug-in.

The CPU tier runs ``tests.offload.hint_policy``'s recording policy (it
protects the keys of queued requests), so every hint that reaches the
tier's policy is visible: arrival (``Scheduler.add_request`` ->
``KVOffloadConnector.on_new_request``), first scheduling
(``on_schedule_end``), resumption after preemption (``build_connector_meta``),
finish and abort (``on_request_finished``), and the session hint from
``kv_transfer_params``.
"""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvoffload.integrations.vllm.scheduler.manager import CONTINUES_PARAM  # noqa: E402
from kvoffload.offload import OffloadKey, make_offload_key  # noqa: E402
from tests.integrations.vllm_rig import BLOCK_SIZE, VLLMRig  # noqa: E402
from tests.offload import hint_policy  # noqa: E402
from tests.offload.hint_policy import RECORDER, HintRecorder, queue_aware_policies  # noqa: E402

PROMPT_LEN = 80  # 5 full blocks


def prompt(i: int) -> list[int]:
    return [1 + 97 * i + j for j in range(PROMPT_LEN)]


def build(
    tmp_path: Path, policy: str = RECORDER, scheduler_cls: type[Scheduler] = Scheduler
) -> tuple[VLLMRig, HintRecorder]:
    rig = VLLMRig.build(
        tmp_path,
        extra_config={"cpu_bytes": "1MiB", "cache_policy": policy},
        scheduler_cls=scheduler_cls,
    )
    return rig, hint_policy.latest()


def add(
    rig: VLLMRig, req_id: str, tokens: list[int], max_tokens: int = 2, **params: Any
) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    request = Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, rig.hash_fn),
    )
    rig.scheduler.add_request(request)
    return request


def full_keys(request: Request) -> list[OffloadKey]:
    return [make_offload_key(bytes(h), 0) for h in request.block_hashes]


def events(p: HintRecorder, req_id: str) -> list[str]:
    return [c[0] for c in p.calls if c[0] != "continues" and c[1] == req_id]


def alternates(seq: list[str]) -> bool:
    """Every announcement is ended before the next one, and the last one too."""
    return bool(seq) and seq == ["queued", "dequeued"] * (len(seq) // 2)


def test_arrival_announces_the_full_block_keys_and_scheduling_dequeues(tmp_path: Path) -> None:
    rig, p = build(tmp_path)
    req = add(rig, "a", [*prompt(0), 1, 2, 3])  # 5 full blocks and a partial one
    assert p.calls == [("queued", "a", full_keys(req))]
    assert len(full_keys(req)) == PROMPT_LEN // BLOCK_SIZE
    assert rig.manager.num_queued_hints() == 1
    rig.step()
    assert p.calls[-1] == ("dequeued", "a")
    assert rig.manager.num_queued_hints() == 0
    rig.run()
    assert events(p, "a") == ["queued", "dequeued"]  # finishing does not dequeue twice
    rig.shutdown()


@pytest.mark.parametrize("scheduler_cls", [Scheduler, AsyncScheduler])
def test_requests_behind_the_budget_stay_queued_until_scheduled(
    tmp_path: Path, scheduler_cls: type[Scheduler]
) -> None:
    rig, p = build(tmp_path, scheduler_cls=scheduler_cls)
    for i in range(5):  # 12 GPU blocks: at most two 6-block requests run at once
        add(rig, f"r{i}", prompt(i))
    rig.step()
    running = {r.request_id for r in rig.scheduler.running}
    assert running and len(running) < 5
    assert set(p.queued) == {f"r{i}" for i in range(5)} - running
    rig.run()
    assert p.queued == {} and rig.manager.num_queued_hints() == 0
    for i in range(5):
        seq = events(p, f"r{i}")
        want = 1 + (f"r{i}" in rig.preempted)  # a preempted one is announced again
        assert seq[:2] == ["queued", "dequeued"] and alternates(seq), seq
        assert len(seq) >= 2 * want
    rig.shutdown()


def test_aborting_a_waiting_request_dequeues_it(tmp_path: Path) -> None:
    rig, p = build(tmp_path)
    for i in range(3):
        add(rig, f"r{i}", prompt(i))
    rig.step()
    waiting = [r for r in ("r0", "r1", "r2") if r in p.queued]
    assert waiting, "the third request should wait for GPU blocks"
    rig.scheduler.finish_requests(waiting[-1], RequestStatus.FINISHED_ABORTED)
    rig.step()  # vLLM tells the connector about finished requests in the next step
    assert waiting[-1] not in p.queued
    assert events(p, waiting[-1]) == ["queued", "dequeued"]
    rig.run()
    assert p.queued == {}
    rig.shutdown()


def test_preempted_requests_are_announced_again_and_dequeued_on_resume(tmp_path: Path) -> None:
    rig = VLLMRig.build(
        tmp_path, num_gpu_blocks=10, extra_config={"cpu_bytes": "1MiB", "cache_policy": RECORDER}
    )
    p = hint_policy.latest()
    for i in range(3):
        add(rig, f"long{i}", [1 + 7 * i + j for j in range(64)], max_tokens=40)
    rig.run(max_steps=400)
    assert rig.preempted, "the GPU tier was meant to be too small for all three"
    for req_id in rig.preempted:
        seq = events(p, req_id)
        assert seq.count("queued") >= 2, seq  # arrival, then once per preemption
        assert alternates(seq), seq
    assert p.queued == {} and rig.manager.num_queued_hints() == 0
    rig.shutdown()


def test_session_hint_from_kv_transfer_params(tmp_path: Path) -> None:
    rig, p = build(tmp_path)
    cont = add(rig, "cont", prompt(0), **{CONTINUES_PARAM: True})
    add(rig, "plain", prompt(1))
    rig.run()
    continued = [c[1] for c in p.calls if c[0] == "continues"]
    assert len(continued) == 1, "only the request that said so continues"
    assert continued[0][: len(full_keys(cont))] == full_keys(cont)
    assert len(set(continued[0])) == len(continued[0])
    rig.shutdown()


def _waiting_request_hits(tmp_path: Path, policy: str) -> int:
    """A's 5 blocks sit in a 20-block CPU tier; a queued re-request of A waits behind a flood.

    Each flood request stores 5 blocks: under LRU the fourth one evicts A; a
    policy that protects queued keys evicts older flood blocks instead. (Stores
    in flight are not evictable: the tier is large enough that two requests'
    stores in flight still leave unprotected blocks to evict.)
    """
    rig = VLLMRig.build(tmp_path, extra_config={"cpu_bytes": 20 * 4096, "cache_policy": policy})
    add(rig, "first", prompt(0))
    rig.run()
    for i in range(1, 5):
        add(rig, f"flood{i}", prompt(i))
    add(rig, "again", [*prompt(0), 5, 6])  # waits behind the flood (FCFS, 12 GPU blocks)
    while rig.scheduler.has_requests():
        rig.step()
        assert rig.kv_worker.wait_all(timeout=60)  # stores settle every step
    rig.run()
    assert rig.mismatches == []
    hits = rig.first_computed["again"]
    rig.shutdown()
    return hits


def test_without_hints_the_flood_evicts_the_waiting_request_s_blocks(tmp_path: Path) -> None:
    assert _waiting_request_hits(tmp_path, "lru") == 0


@pytest.mark.parametrize("policy", queue_aware_policies())
def test_hinted_blocks_survive_while_their_request_waits(tmp_path: Path, policy: str) -> None:
    assert _waiting_request_hits(tmp_path, policy) == PROMPT_LEN


def test_hints_reach_kvoffload_s_policy_under_vllm_s_tiering_manager(tmp_path: Path) -> None:
    """With a disk tier, KVOffloadSpec runs vLLM's tiering manager over KVOffload<Name>Policy."""
    disk = tmp_path / "disk"
    disk.mkdir()
    rig = VLLMRig.build(
        tmp_path,
        extra_config={
            "cpu_bytes": 20 * 4096,
            "disk_dir": str(disk),
            "disk_bytes": "1MiB",
            "cache_policy": RECORDER,
        },
    )
    p = hint_policy.latest()
    assert type(rig.manager).__name__ != "KVOffloadManager"  # vLLM's tiering manager
    reqs = [add(rig, f"r{i}", prompt(i)) for i in range(4)]
    cont = add(rig, "cont", prompt(9), **{CONTINUES_PARAM: True})
    assert p.calls[0] == ("queued", "r0", full_keys(reqs[0]))
    rig.step()
    rig.scheduler.finish_requests("r3", RequestStatus.FINISHED_ABORTED)  # still waiting
    rig.run()
    for req_id in ("r0", "r1", "r2", "r3", "cont"):
        assert alternates(events(p, req_id)), (req_id, events(p, req_id))
    assert p.queued == {}
    assert [c[1] for c in p.calls if c[0] == "continues"] == [full_keys(cont)]
    rig.shutdown()
