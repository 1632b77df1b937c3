"""The default policy ranking chunk units (hybrid models): what its shadows see and model.

Under ``chunk_units`` the default ranks one key per chunk (the block hash
without its group index) and each such unit holds one to one-per-group
slots. Its shadows must sample those keys 1 in ``rate`` (issue 41: they took
every unit of integer-derived ids) and model the tier's size in units, not
in slots (issue 41: a 4-group tier looked up to 1.7 times as large).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.offload import CPUOffloadingManager, OffloadKey, make_offload_key
from kvoffload.offload.chunk_units import GroupLayout
from kvoffload.offload.policies.default.arc_arm import ArcArm
from kvoffload.offload.policies.default.arms import sampled
from kvoffload.offload.policies.default.arms_duel import ArmsDuel
from kvoffload.offload.policies.default.policy_duel import PolicyDuel
from kvoffload.offload.policies.default.shadow_tier import ALL, ARC, BIP, SECOND, ShadowTier


def _unit(i: int) -> OffloadKey:
    """A chunk unit as ``chunk_units`` hands it on: a block hash (here an 8-byte id)."""
    return OffloadKey(i.to_bytes(8, "big"))


def test_units_of_integer_ids_are_sampled_one_in_rate() -> None:
    units = [_unit(i) for i in range(4096)]
    assert len(sampled(units, 15)) == 4096 // 16


def test_one_group_keys_are_sampled_by_the_hash_last_byte_as_before() -> None:
    keys = [make_offload_key(i.to_bytes(8, "big")) for i in range(4096)]
    assert sampled(keys, 15) == [k for k in keys if k[-5] & 15 == 0]
    assert sampled(keys, 0) is keys


def test_the_shadows_of_a_unit_tier_see_one_unit_in_rate() -> None:
    policy = PolicyDuel(8192)
    duel = policy.lru
    assert duel.rate == 16
    policy.access([])  # nothing resident yet: reads are shown through admit
    policy.admit([_unit(i) for i in range(2048)])
    shadow = duel.tiers[ALL]
    assert len(shadow.lru) == 2048 // 16


def _full_groups(n: int) -> tuple[GroupLayout, ...]:
    return tuple(GroupLayout(tokens_per_chunk=16) for _ in range(n))


def _chain_keys(first: int, chunks: int, groups: int) -> list[OffloadKey]:
    """One request's keys, group after group, each in chain order (vLLM's store order)."""
    return [
        make_offload_key(c.to_bytes(8, "big"), g)
        for g in range(groups)
        for c in range(first, first + chunks)
    ]


def _store_chain(m: CPUOffloadingManager, first: int, chunks: int, groups: int) -> None:
    keys = _chain_keys(first, chunks, groups)
    flags = m.admit(keys)
    if flags is not None:
        keys = [k for k, f in zip(keys, flags) if f]
    out = m.prepare_store(keys)
    if out is not None and out.keys_to_store:
        m.complete_store(out.keys_to_store)


def _duel(m: CPUOffloadingManager) -> PolicyDuel:
    policy = m.policy
    while not isinstance(policy, PolicyDuel):
        policy = policy.inner  # type: ignore[attr-defined]
    return policy


@pytest.mark.parametrize("groups", [1, 4])
def test_shadows_model_the_tier_in_units(groups: int) -> None:
    slots = 8192
    m = CPUOffloadingManager(slots, group_layout=_full_groups(groups))
    duel = _duel(m)
    rate = duel.lru.rate
    for r in range(120):
        _store_chain(m, 1000 * r, 64, groups)
    units = slots // groups  # every chunk holds one slot per group
    for tier in duel.lru.tiers:
        assert abs(tier.capacity - units // rate) * 16 <= units // rate
    # The ARC structure's target and ghosts are bounded by the units too.
    assert abs(duel.arc.capacity - units) * 16 <= units
    # The LRU structure (its admission's free room) counts units too; a plain tier's
    # structure keeps its slot count (stores in flight must not shrink it).
    assert abs(duel.lru.capacity - units) * 16 <= units
    if groups == 1:
        assert all(t.capacity == slots // rate for t in duel.lru.tiers)  # as before
        assert duel.arc.capacity == duel.lru.capacity == slots
        assert not duel._units


def test_a_plain_tier_keeps_its_slot_count_with_stores_in_flight() -> None:
    # A tiny plain tier measured when full with a store in flight holds fewer keys than
    # its slots: its LRU structure must not shrink to that (the reverted 60d7799 did).
    m = CPUOffloadingManager(32)
    duel = _duel(m)
    in_flight: list[OffloadKey] = []
    for r in range(200):  # each store completes after the next one is prepared
        keys = [make_offload_key((100 * r + c).to_bytes(8, "big")) for c in range(4)]
        out = m.prepare_store(keys)
        assert out is not None
        if in_flight:
            m.complete_store(in_flight)
        in_flight = out.keys_to_store
    assert duel._resident < 31  # what it holds when full, smoothed: 28 keys and 4 in flight
    assert duel.lru.capacity == 32


def test_a_full_unit_tier_stores_declined_first_sightings_only_in_the_reject_room() -> None:
    m = CPUOffloadingManager(4096, group_layout=_full_groups(4))
    duel = _duel(m)
    for r in range(120):  # chains stored once, never read
        _store_chain(m, 1000 * r, 64, 4)
    duel.lru.mode = duel.lru.choice = SECOND  # (under chunk units no verdict moves it)
    resident = [k for r in range(104, 120) for k in _chain_keys(1000 * r, 64, 4)]
    assert all(k in m.policy for k in resident)
    m.touch(resident)  # read again: every resident chunk is kept, none is a reject
    assert len(duel.lru.rejects) == 0
    # Second sighting declines a fresh chain; a declined chunk is stored only where it costs
    # no kept chunk, and the tier (1,024 chunks) has none such. Counted in slots, admit saw
    # 3,000 free ones and the declined chunks evicted kept ones.
    flags = m.admit(_chain_keys(500_000, 64, 4))
    assert flags is not None and sum(flags) <= 4 * (duel.lru.capacity - 1024)


def test_arc_retarget_bounds_p_and_ghosts_and_keeps_the_resident_keys() -> None:
    arc = ArcArm(100)
    arc.insert([_unit(i) for i in range(100)])
    arc.access([_unit(i) for i in range(50)])  # T2: 0..49, T1: 50..99
    victims = arc.evict(60, [_unit(i) for i in range(100, 160)])
    arc.insert([_unit(i) for i in range(100, 160)])
    arc.p = 90.0
    resident = set(arc.where)
    arc.retarget(40)
    assert arc.capacity == 40 and arc.p == 40.0
    assert set(arc.where) == resident  # the manager evicts, not a retarget
    assert len(arc.b1) + arc.n1 <= 40 or not arc.b1
    assert arc.n1 + arc.n2 + len(arc.b1) + len(arc.b2) <= max(80, len(resident))
    assert len(victims) == 60


def test_a_switch_to_arc_takes_unread_first_sightings_as_seen_once() -> None:
    duel = ArmsDuel(4096)
    assert duel.mode == ALL
    chain = [_unit(i) for i in range(64)]
    assert all(duel.admit(chain) or ())  # all admitted on first sight
    duel.evict(0, chain)
    duel.insert(chain)
    duel.access(chain[:16])  # the head read again
    once, again, pinned = duel.take_resident()
    assert set(once) == set(chain[16:])
    assert set(again) == set(chain[:16])
    assert not pinned


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from([ALL, SECOND, BIP, ARC]),
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
)
def test_a_resized_shadow_holds_at_most_its_capacity(
    mode: int, seed: int, sizes: list[int]
) -> None:
    rnd = random.Random(seed)
    tier = ShadowTier(8, mode, 16, 4)
    universe = [_unit(i) for i in range(40)]
    for size in sizes:
        for _ in range(30):
            if rnd.random() < 0.3:
                tier.broken = False
            tier.step(rnd.sample(universe, rnd.randint(1, 6)))
            assert len(tier) <= tier.capacity
        tier.resize(size)
        assert tier.capacity == size and len(tier) <= size
        if tier.arc is not None:
            arc = tier.arc
            assert arc.n1 == len(arc.t1) and arc.n2 == len(arc.t2)
            assert 0.0 <= arc.p <= size
            assert len(arc.t1) + len(arc.b1) <= size
            assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 2 * size


class _AdmitLog(PolicyDuel):
    """The default's duel, recording the ``in_flight`` each ``admit`` is given."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.in_flight: list[int] = []

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        self.in_flight.append(in_flight)
        return super().admit(keys, in_flight)


def test_stores_in_flight_reach_a_unit_policy_as_chunks() -> None:
    # The manager counts a store's slots in flight (8: 4 chunks of 2 groups); the policy
    # under it ranks chunks and must see 4, else its room shrinks by 4 chunks too many.
    m = CPUOffloadingManager(64, cache_policy=_AdmitLog, group_layout=_full_groups(2))
    log = _duel(m)
    assert isinstance(log, _AdmitLog)
    assert m.prepare_store(_chain_keys(0, 4, 2)) is not None  # in flight, not completed
    m.admit(_chain_keys(1000, 4, 2))
    assert log.in_flight[-1] == 4


def test_an_oversized_store_takes_at_most_half_the_chunks_a_unit_tier_holds() -> None:
    # A 4-group tier of 400 slots holding 100 chunks when full: half the tier for a store
    # larger than the room is 50 chunks, not the 200 of its slots.
    duel = PolicyDuel(400)
    duel.hint_units()
    duel.lru.fit_tier(100)
    flags = duel.admit([_unit(i) for i in range(300)])
    assert flags is not None and sum(flags) == 50
