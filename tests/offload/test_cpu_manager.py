"""CPUOffloadingManager: each rule of the contract, for every policy where it is general."""

import pytest

from kvoffload.offload import (
    DEFAULT_CACHE_POLICY,
    CPULoadStoreSpec,
    CPUOffloadingManager,
    OffloadingEvent,
    OffloadingManager,
    policy_names,
)
from kvoffload.offload.policies import ChainLRUPolicy, all_policies
from tests.offload.keyutil import key, keys

ALL = all_policies()


def stored(m: CPUOffloadingManager, ks: list) -> None:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store)


def test_is_a_manager_with_medium_cpu() -> None:
    m = CPUOffloadingManager(4)
    assert isinstance(m, OffloadingManager)
    assert m.medium == "CPU"
    assert m.num_blocks == 4
    assert m.num_free_blocks() == 4 and m.num_evictable_blocks() == 0
    assert m.cache_policy == DEFAULT_CACHE_POLICY


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(ValueError) as exc:
        CPUOffloadingManager(4, cache_policy="nope")
    for name in policy_names():
        assert name in str(exc.value)


@pytest.mark.parametrize("n", [0, -1])
def test_bad_num_blocks(n: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        CPUOffloadingManager(n)


@pytest.mark.parametrize("policy", ALL)
def test_store_then_lookup_and_load(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    ks = keys(1, 2, 3)
    out = m.prepare_store(ks)
    assert out is not None
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    slots = out.store_spec.block_ids.tolist()
    assert len(set(slots)) == 3 and all(0 <= s < 4 for s in slots)
    # Not loadable until the store completes.
    assert m.lookup(ks) == 0 and not m.is_stored(ks[0]) and m.is_storing(ks[0])
    assert m.num_free_blocks() == 1 and m.num_evictable_blocks() == 0
    m.complete_store(ks)
    assert m.lookup(ks) == 3 and m.is_stored(ks[0])
    assert m.lookup([*ks[:2], key(9), ks[2]]) == 2
    assert m.lookup([key(9), *ks]) == 0
    spec = m.prepare_load([ks[2], ks[0]])
    assert spec.block_ids.tolist() == [slots[2], slots[0]]
    assert spec.medium() == "CPU"
    m.complete_load([ks[2], ks[0]])


@pytest.mark.parametrize("policy", ALL)
def test_already_stored_and_storing_keys_are_left_out(policy: str) -> None:
    m = CPUOffloadingManager(8, policy)
    stored(m, keys(1, 2))
    out = m.prepare_store(keys(1, 3))
    assert out is not None and out.keys_to_store == keys(3)
    again = m.prepare_store(keys(3, 4, 4))
    assert again is not None and again.keys_to_store == keys(4)
    nothing = m.prepare_store(keys(1, 2))
    assert nothing is not None and nothing.keys_to_store == [] and nothing.evicted_keys == []
    assert len(nothing.store_spec) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ALL)
def test_failed_store_frees_slots_and_keys_stay_unknown(policy: str) -> None:
    m = CPUOffloadingManager(4, policy, enable_events=True)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    m.complete_store(out.keys_to_store, success=False)
    assert m.num_free_blocks() == 4
    assert m.lookup(keys(1, 2)) == 0 and not m.is_storing(key(1)) and m.slot_of(key(1)) is None
    assert list(m.take_events()) == []
    again = m.prepare_store(keys(1, 2))
    assert again is not None and again.keys_to_store == keys(1, 2)


@pytest.mark.parametrize("policy", ALL)
def test_pinned_blocks_are_never_evicted(policy: str) -> None:
    m = CPUOffloadingManager(3, policy)
    stored(m, keys(1, 2, 3))
    m.prepare_load(keys(1, 2, 3))
    assert m.num_evictable_blocks() == 0
    before = (m.num_free_blocks(), [m.slot_of(k) for k in keys(1, 2, 3)])
    assert m.prepare_store(keys(4)) is None
    # None changes nothing.
    assert (m.num_free_blocks(), [m.slot_of(k) for k in keys(1, 2, 3)]) == before
    assert m.lookup(keys(1, 2, 3)) == 3 and not m.is_storing(key(4))
    m.complete_load(keys(2))
    out = m.prepare_store(keys(4))
    assert out is not None and out.evicted_keys == keys(2)
    assert m.prepare_store(keys(5)) is None  # 1 and 3 still pinned, 4 storing


@pytest.mark.parametrize("policy", ALL)
def test_pins_are_reference_counted(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, keys(1, 2))
    m.prepare_load(keys(1))
    m.prepare_load(keys(1))  # a second request loads the same block
    assert m.ref_count(key(1)) == 2
    m.complete_load(keys(1))
    assert m.ref_count(key(1)) == 1
    out = m.prepare_store(keys(3))
    assert out is not None and out.evicted_keys == keys(2)
    m.complete_store(keys(3))
    # 1 is still pinned and 3 is part of the store itself: no room for 4.
    assert m.prepare_store(keys(3, 4)) is None
    m.complete_load(keys(1))
    assert m.ref_count(key(1)) == 0
    out = m.prepare_store(keys(3, 4))
    assert out is not None and out.evicted_keys == keys(1)


@pytest.mark.parametrize("policy", ALL)
def test_storing_keys_are_not_evictable(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    assert m.prepare_store(keys(3)) is None
    m.complete_store(keys(1))
    out = m.prepare_store(keys(3))
    assert out is not None and out.evicted_keys == keys(1)


@pytest.mark.parametrize("policy", ALL)
def test_keys_of_the_store_itself_are_protected(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, keys(1, 2))
    # 1 is part of the store: evicting it for 3 would defeat the store.
    out = m.prepare_store(keys(1, 3))
    assert out is not None and out.evicted_keys == keys(2) and out.keys_to_store == keys(3)
    m.complete_store(keys(3))
    assert m.prepare_store(keys(1, 3, 4)) is None


@pytest.mark.parametrize("policy", ALL)
def test_store_larger_than_capacity_is_refused(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    assert m.prepare_store(keys(1, 2, 3)) is None
    assert m.num_free_blocks() == 2


@pytest.mark.parametrize("policy", ALL)
def test_evicted_spec_names_the_slots_being_reused(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, keys(1, 2))
    slot1, slot2 = m.slot_of(key(1)), m.slot_of(key(2))
    out = m.prepare_store(keys(3, 4))
    assert out is not None
    assert sorted(out.evicted_keys) == sorted(keys(1, 2))
    assert out.evicted_spec is not None
    old = {key(1): slot1, key(2): slot2}
    assert out.evicted_spec.block_ids.tolist() == [old[k] for k in out.evicted_keys]
    assert sorted(out.store_spec.block_ids.tolist()) == sorted([slot1, slot2])  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ALL)
def test_load_of_unknown_or_storing_key_is_an_error(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    with pytest.raises(ValueError):
        m.prepare_load(keys(1))
    m.prepare_store(keys(1))
    with pytest.raises(ValueError):
        m.prepare_load(keys(1))
    with pytest.raises(ValueError):
        m.complete_load(keys(1))
    m.complete_store(keys(2))  # unknown: ignored (vLLM 0.33)
    assert m.is_storing(key(1))
    m.complete_store(keys(1))
    m.complete_store(keys(1))  # already stored: ignored
    m.complete_store(keys(1), success=False)  # ... on failure too
    assert m.is_stored(key(1))
    m.prepare_load(keys(1))
    with pytest.raises(ValueError):
        m.complete_load(keys(1, 1))
    assert m.ref_count(key(1)) == 1  # the failed call changed nothing


@pytest.mark.parametrize("policy", ALL)
def test_touch_ignores_unknown_and_storing_keys(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    stored(m, keys(1))
    m.prepare_store(keys(2))
    m.touch(keys(1, 2, 3))
    assert m.lookup(keys(1)) == 1


@pytest.mark.parametrize("policy", ALL)
def test_a_key_repeated_in_one_call(policy: str) -> None:
    # Admission policies once raised KeyError promoting a first-sighting key
    # that one touch named twice.
    m = CPUOffloadingManager(4, policy)
    stored(m, keys(1, 2))
    m.touch(keys(1, 1))
    m.touch(keys(2, 1, 2))
    assert m.lookup(keys(1, 2)) == 2
    stored(m, keys(3))
    spec = m.prepare_load(keys(3, 3))  # one request's prefix names a block twice
    assert spec.block_ids.tolist() == [m.slot_of(key(3))] * 2
    assert m.ref_count(key(3)) == 2
    m.complete_load(keys(3, 3))
    assert m.ref_count(key(3)) == 0
    assert m.num_evictable_blocks() == m.num_stored_blocks() == 3


def test_events_contents_and_order() -> None:
    m = CPUOffloadingManager(3, "lru", enable_events=True)
    assert list(m.take_events()) == []
    stored(m, keys(1, 2))
    stored(m, keys(3))
    assert m.take_events() == [
        OffloadingEvent(keys(1, 2), "CPU", removed=False),
        OffloadingEvent(keys(3), "CPU", removed=False),
    ]
    assert m.take_events() == []
    out = m.prepare_store(keys(4, 5))
    assert out is not None
    # LRU with chain order: a call's head is its newest key, so 2 goes before 1.
    assert out.evicted_keys == keys(2, 1)
    assert m.take_events() == [OffloadingEvent(keys(2, 1), "CPU", removed=True)]
    m.complete_store(keys(4), success=False)
    m.complete_store(keys(5))
    assert m.take_events() == [OffloadingEvent(keys(5), "CPU", removed=False)]


@pytest.mark.parametrize("policy", ALL)
def test_no_events_when_disabled(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, keys(1, 2))
    stored(m, keys(3, 4))
    assert list(m.take_events()) == []


@pytest.mark.parametrize("policy", ALL)
def test_slots_are_reused_and_stay_in_range(policy: str) -> None:
    m = CPUOffloadingManager(5, policy)
    for i in range(50):
        stored(m, keys(3 * i, 3 * i + 1, 3 * i + 2))
        live = [m.slot_of(k) for k in keys(3 * i, 3 * i + 1, 3 * i + 2)]
        assert len(set(live)) == 3 and all(s is not None and 0 <= s < 5 for s in live)
        assert m.num_free_blocks() + m.num_stored_blocks() == 5


def test_lru_evicts_least_recently_used_and_touch_refreshes() -> None:
    m = CPUOffloadingManager(3, "lru")
    stored(m, keys(1))
    stored(m, keys(2))
    stored(m, keys(3))
    m.touch(keys(1))
    out = m.prepare_store(keys(4))
    assert out is not None and out.evicted_keys == keys(2)
    m.complete_store(keys(4))
    m.prepare_load(keys(3))
    m.complete_load(keys(3))  # a load is a use
    out = m.prepare_store(keys(5))
    assert out is not None and out.evicted_keys == keys(1)


def test_chain_lru_keeps_a_prefix_ahead_of_its_continuation() -> None:
    # A conversation's prefix is loaded, then its continuation stored: the
    # continuation must go before the prefix when the conversation goes cold.
    for policy, expect_head_kept in ((ChainLRUPolicy, True), ("lru", False)):
        m = CPUOffloadingManager(6, policy)
        prefix, cont = keys(1, 2, 3), keys(4, 5)
        stored(m, prefix)
        prompt = prefix + cont
        hit = m.lookup(prompt)
        assert hit == 3
        m.prepare_load(prompt[:hit])
        m.complete_load(prompt[:hit])
        stored(m, prompt[hit:])
        stored(m, keys(10))  # fills the last slot
        out = m.prepare_store(keys(11, 12))
        assert out is not None
        if expect_head_kept:
            assert out.evicted_keys == keys(5, 4)
            assert m.lookup(prompt) == 3
        else:
            assert out.evicted_keys == keys(3, 2)
            assert m.lookup(prompt) == 1


@pytest.mark.parametrize("policy", ALL)
def test_complete_store_accepts_the_keys_given_to_prepare_store(policy: str) -> None:
    """vLLM 0.33: keys already stored among them are ignored, on success and failure."""
    m = CPUOffloadingManager(4, policy, enable_events=True)
    stored(m, keys(1))
    m.take_events()
    out = m.prepare_store(keys(1, 2))
    assert out is not None and out.keys_to_store == keys(2)
    m.complete_store(keys(1, 2))
    assert m.is_stored(key(1)) and m.is_stored(key(2))
    assert m.take_events() == [OffloadingEvent(keys(2), "CPU", removed=False)]
    out = m.prepare_store(keys(1, 2, 3))
    assert out is not None and out.keys_to_store == keys(3)
    m.complete_store(keys(1, 2, 3), success=False)
    assert m.is_stored(key(1)) and m.is_stored(key(2)) and m.slot_of(key(3)) is None
    assert m.num_free_blocks() == 2 and m.take_events() == []


@pytest.mark.parametrize("policy", ALL)
def test_reset_cache_forgets_everything_and_announces_it(policy: str) -> None:
    m = CPUOffloadingManager(3, policy, enable_events=True)
    stored(m, keys(1, 2))
    m.take_events()
    assert m.reset_cache() is True
    assert m.take_events() == [OffloadingEvent(keys(1, 2), "CPU", removed=True)]
    assert m.lookup(keys(1)) == 0 and m.num_free_blocks() == 3 and m.num_stored_blocks() == 0
    assert m.reset_cache() is True and m.take_events() == []  # empty: no event
    stored(m, keys(4, 5, 6))  # the whole capacity is usable again
    assert m.lookup(keys(4, 5, 6)) == 3


@pytest.mark.parametrize("policy", ALL)
def test_reset_cache_refuses_while_pinned_or_storing_unless_forced(policy: str) -> None:
    m = CPUOffloadingManager(3, policy, enable_events=True)
    stored(m, keys(1))
    m.prepare_load(keys(1))
    assert not m.can_reset_cache() and m.reset_cache() is False
    assert m.is_stored(key(1)) and m.ref_count(key(1)) == 1  # nothing changed
    m.complete_load(keys(1))
    m.prepare_store(keys(2))
    assert m.reset_cache() is False and m.is_storing(key(2))
    m.take_events()
    assert m.reset_cache(force=True) is True  # vLLM's reset: busy keys go too
    assert m.take_events() == [OffloadingEvent(keys(1), "CPU", removed=True)]
    assert not m.is_storing(key(2)) and m.num_free_blocks() == 3
    m.complete_store(keys(2))  # a stale completion is ignored
    assert m.lookup(keys(2)) == 0
