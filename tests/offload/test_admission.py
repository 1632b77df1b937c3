"""``OffloadingManager.admit``: which new keys of a store are worth a slot.

Contract: keys already stored are always admitted; a declined key is not
stored by a caller that follows the answer (a later sighting may admit it);
the policy's shadows, history and duel see every offer exactly once, so its
decisions are those it took when every key was stored and the rejects were
evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.bench.policy.traces import generate, trace_keys
from kvoffload.offload import CPUOffloadingManager, OffloadKey
from kvoffload.offload.policies.default.arms import SECOND, ArmsChainLRUPolicy
from kvoffload.offload.policies.default.queue import QueueArmsPolicy
from kvoffload.tiers.tiered_manager import TieredOffloadingManager
from tests.offload.keyutil import keys


def _store(m: CPUOffloadingManager, ks: Sequence[OffloadKey], ask: bool) -> list[OffloadKey]:
    """Offer ``ks`` as a connector does (``ask``: admitted keys only); the keys stored."""
    if ask:
        flags = m.admit(ks)
        if flags is not None:
            ks = [k for k, f in zip(ks, flags) if f]
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(ks)
    return list(out.keys_to_store)


def _second(policy: object) -> None:
    """Put queue_arms's LRU structure in second-sighting mode (it starts admitting all)."""
    duel = policy.inner  # type: ignore[attr-defined]
    duel.lru.mode = duel.lru.choice = SECOND


def _full(policy: str = "chain_arms", cap: int = 8) -> CPUOffloadingManager:
    m = CPUOffloadingManager(cap, cache_policy=policy)
    if policy == "queue_arms":
        _second(m.policy)
    for i in range(cap):  # stored as rejects (spare room), read again: promoted into the LRU
        _store(m, keys(100 + i), ask=True)
        m.prepare_load(keys(100 + i))
        m.complete_load(keys(100 + i))
    assert m.num_free_blocks() == 0
    return m


def test_policies_without_admission_admit_everything() -> None:
    m = CPUOffloadingManager(4, cache_policy="lru")
    _store(m, keys(1, 2, 3, 4), ask=False)
    assert m.admit(keys(5, 6, 7)) is None
    assert CPUOffloadingManager(4).admit([]) is None


def test_first_sighting_declined_on_a_full_tier_then_admitted() -> None:
    m = _full()
    assert m.policy.mode == SECOND  # type: ignore[attr-defined]
    stored = keys(100, 101)
    flags = m.admit([*stored, *keys(1, 2)])
    assert flags == [True, True, False, False]  # stored keys always; new ones declined
    assert not m.is_stored(keys(1)[0])
    # Being asked was their first sighting: the next offer is the second, admitted.
    assert _store(m, keys(1, 2), ask=True) == keys(1, 2)
    assert all(k in m.policy.inner for k in keys(1, 2))  # type: ignore[attr-defined]


def test_declined_keys_take_no_slot() -> None:
    m = _full()
    before = {k for k in keys(*range(100, 108)) if m.is_stored(k)}
    assert len(before) == 8
    assert _store(m, keys(1, 2, 3), ask=True) == []
    assert not any(m.is_stored(k) for k in keys(1, 2, 3))
    assert {k for k in before if m.is_stored(k)} == before  # nothing useful evicted
    # Without asking, the same store evicts three kept blocks (the old slot cost).
    m2 = _full()
    assert len(_store(m2, keys(1, 2, 3), ask=False)) == 3
    assert sum(m2.is_stored(k) for k in before) == 5


def test_declined_keys_use_spare_room_as_rejects() -> None:
    m = CPUOffloadingManager(8, cache_policy="chain_arms")
    assert m.admit(keys(1, 2, 3)) is None  # first sightings, but the tier has room
    out = m.prepare_store(keys(1, 2, 3))
    assert out is not None and out.keys_to_store == keys(1, 2, 3)
    m.complete_store(keys(1, 2, 3))
    assert all(k in m.policy.rejects for k in keys(1, 2, 3))  # type: ignore[attr-defined]


def test_queued_keys_are_always_admitted() -> None:
    m = _full("queue_arms")
    m.hint_queued("r", keys(2))
    assert m.admit(keys(1, 2)) == [False, True]
    assert _store(m, keys(2), ask=True) == keys(2)
    assert m.policy.is_held(keys(2)[0])  # type: ignore[attr-defined]


def test_tiered_manager_forwards_to_its_cpu_tier() -> None:
    cpu = _full()
    t = TieredOffloadingManager(cpu, [])
    assert t.admit([*keys(100), *keys(1)]) == [True, False]


def _state(p: ArmsChainLRUPolicy) -> tuple[object, ...]:
    tiers = getattr(p, "tiers", None)  # queue_arms's LRU structure: shadow tiers
    if tiers is not None:
        shadows = tuple((tuple(t.lru), tuple(t.rejects), len(t)) for t in tiers)
    else:
        shadows = tuple((tuple(s.main), tuple(s.rejects)) for s in p.shadows)
    return (
        p.mode,
        getattr(p, "choice", None),
        tuple(p.scores),
        p._calls,
        p._stores,
        p._max_store,
        tuple(p.history),
        shadows,
    )


def test_admit_sees_each_offer_once_as_evict_did() -> None:
    """Same offers, once asked ahead and once through ``evict`` alone: same state."""
    a, b = ArmsChainLRUPolicy(8), ArmsChainLRUPolicy(8)
    for p in (a, b):
        p.evict(0, keys(*range(8)))
        p.insert(keys(*range(8)))
        p.access(keys(*range(8)))  # read again: promoted, the LRU holds the tier
    # Every batch is new to both: ``b`` keeps 20-22 as rejects and evicts them for 30-32.
    for batch, expect in (
        (keys(20, 21, 22), False),
        (keys(30, 31, 32), False),
        (keys(20, 21), True),
    ):
        assert not any(k in a or k in b for k in batch)
        flags = a.admit(batch)
        assert flags == [expect] * len(batch)
        if expect:
            assert len(a.evict(len(batch), batch)) == len(batch)
            a.insert(batch)
        b.evict(len(batch), batch)
        b.insert(batch)
        assert _state(a) == _state(b)
    # The second sightings went to the LRU in both; ``a`` kept every block it held.
    assert all(k in a.inner and k in b.inner for k in keys(20, 21))
    assert sum(k in a for k in keys(*range(8))) == 6
    assert sum(k in b for k in keys(*range(8))) == 5


def test_large_tier_same_decisions_as_storing_everything() -> None:
    """Where declined keys fit in spare room, asking changes nothing but nothing is doubled."""
    trace = trace_keys(generate("agent", 300, seed=5))
    unique = len({k for ks in trace for k in ks})
    ms = [CPUOffloadingManager(unique + 8, cache_policy="queue_arms") for _ in range(2)]
    for ks in trace:
        for m, ask in zip(ms, (True, False)):
            hit = m.lookup(ks)
            if hit:
                m.prepare_load(ks[:hit])
                m.complete_load(ks[:hit])
            if ks[hit:]:
                _store(m, ks[hit:], ask)
    pa, pb = (m.policy.inner.lru for m in ms)  # type: ignore[attr-defined]
    assert _state(pa) == _state(pb)
    assert list(pa.rejects) == list(pb.rejects)


def test_queue_wrapper_without_wants_is_its_inner_answer() -> None:
    p = QueueArmsPolicy(4)
    _second(p)
    p.evict(0, keys(1, 2, 3, 4))
    p.insert(keys(1, 2, 3, 4))
    p.access(keys(1, 2, 3, 4))
    assert p.admit(keys(9)) == [False]
