"""Why no online policy is at or above the best of vLLM's policies on every trace.

With a tier of c blocks, send block ``a`` twice, then c fresh blocks
``b_1 .. b_c`` (one block a request). vLLM's LRU then holds ``b_1 .. b_c``
(it evicted ``a``); vLLM's ARC holds ``a`` and ``b_2 .. b_c`` (``a`` is in T2,
and ARC evicted T1's oldest, ``b_1``). Both have one hit so far, and no policy
can have more. Their union is c + 1 blocks, so any policy lacks one of them;
a last request for that block is a miss for the policy and a hit for LRU or
ARC (for both unless it is ``a`` or ``b_1``). Whatever a policy keeps, one of
these c + 1 traces puts it a hit below the better of the two: "at least vLLM's
best on every trace" cannot hold for any online policy, at any capacity >= 2,
with or without randomness (it lacks some block with probability 1). The
tests replay the traces through vLLM 0.33's own managers and every kvoffload
policy.
"""

from __future__ import annotations

import pytest

from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.bench.policy.replay import replay
from kvoffload.offload import OffloadKey, make_offload_key
from kvoffload.offload.policies import CachePolicy, all_policies
from tests.vllm_required import need_vllm

need_vllm()


def _key(name: str) -> OffloadKey:
    return make_offload_key(name.encode().ljust(8, b"."))


def _traces(capacity: int) -> dict[str, list[list[OffloadKey]]]:
    """Last block -> the trace: a, a, b_1 .. b_c, then that block (one block a request)."""
    fresh = [f"b{i}" for i in range(1, capacity + 1)]
    return {last: [[_key(n)] for n in ["a", "a", *fresh, last]] for last in ["a", *fresh]}


def _vllm_hits(trace: list[list[OffloadKey]], row: str, capacity: int) -> int:
    policy, threshold = offload_vllm.ROWS[row]
    return offload_vllm.replay(trace, policy, capacity, threshold)[0]


@pytest.mark.parametrize("capacity", [2, 3, 8])
def test_vllm_lru_and_arc_each_hit_what_the_other_evicted(capacity: int) -> None:
    for last, trace in _traces(capacity).items():
        lru = _vllm_hits(trace, "vllm:lru", capacity)
        arc = _vllm_hits(trace, "vllm:arc", capacity)
        assert (lru, arc) == {"a": (1, 2), "b1": (2, 1)}.get(last, (2, 2)), last


@pytest.mark.parametrize("capacity", [2, 3, 8])
@pytest.mark.parametrize("policy", all_policies())
def test_every_policy_trails_the_better_one_on_some_trace(
    policy: str | type[CachePolicy], capacity: int
) -> None:
    below = []
    for last, trace in _traces(capacity).items():
        best = max(_vllm_hits(trace, row, capacity) for row in offload_vllm.ROWS)
        ours = replay(trace, policy, capacity).hit_blocks
        assert ours <= best, (last, ours, best)  # nothing can beat 2 hits here
        if ours < best:
            below.append(last)
    assert below, f"{policy} matched vLLM's best on all {capacity + 1} traces"
