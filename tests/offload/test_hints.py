"""Queue and session hints through the manager contract (issue 20).

Every manager accepts the three hints; the CPU manager forwards them to its
policy (and re-announces queued requests after a reset); the tiered manager
forwards them to its CPU tier. A policy that protects queued keys keeps a
hinted block stored while its request waits.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvoffload.offload import CPUOffloadingManager, OffloadingManager, OffloadKey
from kvoffload.tiers.tiered_manager import TieredOffloadingManager
from tests.offload import hint_policy
from tests.offload.hint_policy import RECORDER, queue_aware_policies
from tests.offload.keyutil import keys


def _store(m: OffloadingManager, ks: Sequence[OffloadKey]) -> list[OffloadKey]:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store, success=True)
    return out.evicted_keys


def test_every_manager_accepts_hints_as_no_ops() -> None:
    m = CPUOffloadingManager(2, "lru")
    _store(m, keys(1, 2))
    m.hint_queued("a", keys(1, 2, 3))
    m.hint_continues(keys(1))
    m.hint_dequeued("a")
    m.hint_dequeued("never-seen")
    assert m.lookup(keys(1, 2)) == 2


def test_cpu_manager_forwards_to_its_policy() -> None:
    m = CPUOffloadingManager(4, RECORDER)
    p = hint_policy.latest()
    m.hint_queued("a", iter(keys(1, 2)))  # any iterable of keys, passed on as a list
    m.hint_continues(keys(3))
    m.hint_dequeued("a")
    m.hint_dequeued("a")  # a second dequeue is the caller's habit, not the policy's problem
    assert p.calls == [
        ("queued", "a", keys(1, 2)),
        ("continues", keys(3)),
        ("dequeued", "a"),
    ]


def test_tiered_manager_forwards_to_the_cpu_tier() -> None:
    cpu = CPUOffloadingManager(4, RECORDER)
    p = hint_policy.latest()
    m = TieredOffloadingManager(cpu, [])
    m.hint_queued("r", keys(5, 6))
    m.hint_continues(keys(5))
    m.hint_dequeued("r")
    assert p.calls == [("queued", "r", keys(5, 6)), ("continues", keys(5)), ("dequeued", "r")]


def test_queue_hints_survive_a_reset() -> None:
    m = CPUOffloadingManager(4, RECORDER)
    m.hint_queued("a", keys(1, 2))
    m.hint_queued("b", keys(3))
    m.hint_dequeued("b")
    assert m.reset_cache()
    fresh = hint_policy.latest()
    assert fresh.calls == [("queued", "a", keys(1, 2))]


@pytest.mark.parametrize("policy", queue_aware_policies())
def test_hinted_block_is_not_evicted_while_its_request_waits(policy: str) -> None:
    m = CPUOffloadingManager(3, policy)
    _store(m, keys(1, 2, 3))  # LRU order after a chain store: 3, 2, 1 (tail first)
    m.hint_queued("w", keys(3))
    for i in range(10, 16):
        evicted = _store(m, keys(i))
        assert keys(3)[0] not in evicted
        assert m.is_stored(keys(3)[0])
    assert m.lookup(keys(3)) == 1
    m.hint_dequeued("w")
    if policy == RECORDER:  # what follows the wait is each real policy's own business
        evicted = []
        for i in range(20, 23):
            evicted += _store(m, keys(i))
        assert keys(3)[0] in evicted  # protection ends with the request's wait


def test_requeue_replaces_the_keys() -> None:
    m = CPUOffloadingManager(2, RECORDER)
    _store(m, keys(1, 2))
    m.hint_queued("p", keys(1))
    m.hint_queued("p", keys(2))  # preempted and re-announced with other blocks
    p = hint_policy.latest()
    assert set(p.protected) == set(keys(2))
    evicted = _store(m, keys(9))
    assert evicted == keys(1)
