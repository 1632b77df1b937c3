"""Queue and session hints from the reference engine's own scheduler (issue 20).

The CPU tier runs ``tests.offload.hint_policy``'s recording policy, which
protects the keys of queued requests, so every hint that reaches the tier is
visible: ``hint_queued`` at arrival (hashed then), again on preemption;
``hint_dequeued`` on admission, abort or finish; ``hint_continues`` when a
request marked ``continues`` finishes.
"""

from __future__ import annotations

import pytest

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.llm_engine import LLMEngine
from kvoffload.engine.request import SamplingParams
from kvoffload.offload import OffloadKey, make_offload_key
from tests.offload import hint_policy
from tests.offload.hint_policy import RECORDER, HintRecorder, queue_aware_policies

BS = 8


def engine(policy: str = RECORDER, **kw: object) -> tuple[LLMEngine, HintRecorder | None]:
    base: dict[str, object] = dict(
        block_size=BS,
        num_gpu_blocks=24,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        num_cpu_blocks=64,
        cache_policy=policy,
    )
    base.update(kw)
    e = LLMEngine(EngineConfig(**base))  # type: ignore[arg-type]
    return e, hint_policy.latest() if policy == RECORDER else None


def prompt(i: int, n: int = 4 * BS + 3) -> list[int]:
    return [(13 * i + 5 * j + 1) % 500 for j in range(n)]


def keys_of(e: LLMEngine, req_id: str) -> list[OffloadKey]:
    req = e._requests[req_id]
    return [make_offload_key(bytes(h), 0) for h in req.block_hashes]


def events(p: HintRecorder, req_id: str) -> list[str]:
    return [c[0] for c in p.calls if c[0] != "continues" and c[1] == req_id]


def alternates(seq: list[str]) -> bool:
    return bool(seq) and seq == ["queued", "dequeued"] * (len(seq) // 2)


def run(e: LLMEngine) -> dict[str, object]:
    outs = {}
    while e.has_unfinished_requests():
        for out in e.step():
            outs[out.req_id] = out
    e.drain()
    return outs


def test_arrival_announces_full_blocks_and_admission_dequeues() -> None:
    e, p = engine()
    assert p is not None
    ids = [e.add_request(prompt(i), SamplingParams(max_tokens=2)) for i in range(3)]
    for rid in ids:
        assert p.queued[rid] == keys_of(e, rid)
        assert len(p.queued[rid]) == 4  # full blocks only: the 3-token tail is not announced
    e.step()  # max_num_seqs=1: only the first is admitted
    assert set(p.queued) == set(ids[1:])
    run(e)
    assert p.queued == {}
    for rid in ids:
        assert alternates(events(p, rid))


def test_abort_of_a_waiting_request_dequeues_it() -> None:
    e, p = engine()
    assert p is not None
    a = e.add_request(prompt(0), SamplingParams(max_tokens=4))
    b = e.add_request(prompt(1), SamplingParams(max_tokens=4))
    e.step()
    assert b in p.queued
    e.abort_request(b)
    assert b not in p.queued and events(p, b) == ["queued", "dequeued"]
    run(e)
    assert events(p, a) == ["queued", "dequeued"]


def test_preempted_requests_are_announced_again() -> None:
    # 9 usable GPU blocks, two requests that each grow to 5-6 blocks: one is preempted.
    e, p = engine(num_gpu_blocks=10, max_num_seqs=2)
    assert p is not None
    ids = [
        e.add_request(prompt(i, 3 * BS), SamplingParams(max_tokens=2 * BS + 4)) for i in range(2)
    ]
    outs = run(e)
    preempted = [rid for rid in ids if outs[rid].num_preemptions]  # type: ignore[attr-defined]
    assert preempted, "the GPU tier was meant to be too small for both"
    for rid in preempted:
        seq = events(p, rid)
        assert seq.count("queued") >= 2 and alternates(seq), seq
        # The re-announcement carries the blocks computed before preemption too.
        requeued = [c[2] for c in p.calls if c[0] == "queued" and c[1] == rid][1]
        assert len(requeued) > 3
    assert p.queued == {}


def test_session_hint_on_finish() -> None:
    e, p = engine()
    assert p is not None
    c = e.add_request(prompt(0), SamplingParams(max_tokens=BS + 1), continues=True)
    e.add_request(prompt(1), SamplingParams(max_tokens=2))
    req = e._requests[c]
    run(e)
    continued = [call[1] for call in p.calls if call[0] == "continues"]
    # Only the continuing request, with every full block of its prompt and output.
    assert continued == [[make_offload_key(bytes(h), 0) for h in req.block_hashes]]
    assert len(continued[0]) == (len(prompt(0)) + BS + 1) // BS


def _again_tier_hit_tokens(policy: str) -> int:
    """A's 4 blocks sit in a 16-block CPU tier; a re-request of A waits behind a flood.

    Each flood request stores 4 blocks: under LRU the fourth one evicts A; a
    policy that protects queued keys evicts older flood blocks instead. (Stores
    in flight are not evictable: the tier is large enough that two requests'
    stores in flight still leave unprotected blocks to evict.)
    """
    e, _ = engine(policy, num_gpu_blocks=12, num_cpu_blocks=16)
    e.add_request(prompt(0), SamplingParams(max_tokens=1), req_id="first")
    run(e)
    for i in range(1, 5):
        e.add_request(prompt(i), SamplingParams(max_tokens=1), req_id=f"flood{i}")
    e.add_request(prompt(0), SamplingParams(max_tokens=1), req_id="again")
    outs = {}
    while e.has_unfinished_requests():
        for out in e.step():
            outs[out.req_id] = out
        e.drain()  # stores settle every step, whatever the machine's speed
    return outs["again"].num_tier_hit_tokens  # type: ignore[attr-defined]


def test_without_hints_the_flood_evicts_the_waiting_request_s_blocks() -> None:
    assert _again_tier_hit_tokens("lru") == 0


@pytest.mark.parametrize("policy", queue_aware_policies())
def test_hinted_blocks_are_not_evicted_while_their_request_waits(policy: str) -> None:
    assert _again_tier_hit_tokens(policy) == 4 * BS
