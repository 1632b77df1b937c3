"""Cache policies on their own: eviction orders, ARC adaptation, registry."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.offload.policies import (
    POLICIES,
    ARCPolicy,
    CachePolicy,
    ChainLRUPolicy,
    FlatLRUPolicy,
    LRUPolicy,
    all_policies,
    make_policy,
    policy_menu,
    policy_names,
    register_policy,
)
from kvoffload.offload.policies.admission import AdmitARCPolicy, AdmitLRUPolicy, SecondSightPolicy
from tests.offload.keyutil import key, keys


def one_by_one(policy: CachePolicy, *ids: int) -> None:
    for i in ids:
        policy.insert([key(i)])


def test_the_menu_names_only_what_a_user_picks_and_blocks_stay_classes() -> None:
    assert {"lru", "arc", DEFAULT_CACHE_POLICY} <= set(policy_names())
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(ValueError, match=f"known: {', '.join(policy_names())}$"):
        make_policy("lfu", 4)
    with pytest.raises(ValueError, match="known:"):
        make_policy("chain_lru", 4)  # a building block: importable, not a name
    assert isinstance(make_policy(ChainLRUPolicy, 4), ChainLRUPolicy)
    # (Tests may register policies of their own: the built-in menu is checked by name.)
    menu = dict(line.split(": ", 1) for line in policy_menu().splitlines())
    assert next(iter(menu)) == DEFAULT_CACHE_POLICY
    for name in (DEFAULT_CACHE_POLICY, "chain_arms", "lru", "arc"):
        assert len(menu[name]) > 20, name
    with pytest.raises(ValueError, match="capacity"):
        make_policy("lru", 0)


def test_register_rejects_a_second_class_under_a_taken_name() -> None:
    class Other(LRUPolicy):
        name = "lru"

    with pytest.raises(ValueError, match="already registered"):
        register_policy(Other)
    assert register_policy(LRUPolicy) is LRUPolicy
    assert POLICIES["lru"] is LRUPolicy


@pytest.mark.parametrize("cls", [LRUPolicy, ChainLRUPolicy])
def test_lru_order(cls: type[LRUPolicy] | type[ChainLRUPolicy]) -> None:
    p = cls(8)
    one_by_one(p, 1, 2, 3)
    p.access(keys(1))
    assert p.lru_order() == keys(2, 3, 1)
    assert p.evict(2, []) == keys(2, 3)
    assert len(p) == 1 and key(1) in p and key(2) not in p


@pytest.mark.parametrize("cls", [LRUPolicy, ChainLRUPolicy])
def test_lru_takes_a_chain_tail_first(cls: type[LRUPolicy] | type[ChainLRUPolicy]) -> None:
    p = cls(8)
    p.insert(keys(1, 2, 3))  # one chain, head first
    assert p.evict(3, []) == keys(3, 2, 1)
    p.insert(keys(4, 5))
    p.insert(keys(6))
    p.access(keys(4, 5))
    assert p.evict(3, []) == keys(6, 5, 4)


def test_flat_lru_takes_keys_in_the_order_given() -> None:
    p = FlatLRUPolicy(8)
    p.insert(keys(1, 2, 3))
    assert p.evict(3, []) == keys(1, 2, 3)


@pytest.mark.parametrize("cls", [LRUPolicy, ChainLRUPolicy])
def test_lru_pinned_keys_leave_and_return_as_most_recent(
    cls: type[LRUPolicy] | type[ChainLRUPolicy],
) -> None:
    p = cls(8)
    one_by_one(p, 1, 2, 3)
    p.pin(keys(1))
    assert p.num_evictable() == 2 and len(p) == 3
    assert p.evict(1, []) == keys(2)
    p.unpin(keys(1))
    assert p.lru_order() == keys(3, 1)


def test_chain_lru_places_a_hinted_continuation_behind_its_parent() -> None:
    p = ChainLRUPolicy(8)
    p.insert(keys(1, 2))  # order: 2, 1 (head newest)
    one_by_one(p, 9)  # an unrelated, newer key
    p.hint_parent(key(3), key(2))
    p.insert(keys(3, 4))
    assert p.lru_order() == keys(4, 3, 2, 1, 9)
    # No hint: like lru.
    p.insert(keys(5))
    assert p.lru_order()[-1] == key(5)
    # A pinned parent cannot anchor: the continuation goes to the recent end.
    p.pin(keys(1))
    p.hint_parent(key(6), key(1))
    p.insert(keys(6))
    assert p.lru_order()[-1] == key(6)


def test_chain_lru_store_that_evicts_its_parent_goes_behind_the_chain_left() -> None:
    # Chain 1, 2, 3 read again (head newest), an older key 9; the store of 4..7 continues
    # 3 and needs two slots: the run takes 9 and 3 (the chain's tail first). The new keys
    # then go behind 2, the chain's last block left, not to the recent end (where the
    # chain's stored head 1, 2 would be the next victims, ahead of its new tail).
    p = ChainLRUPolicy(6)
    one_by_one(p, 9)
    p.insert(keys(1, 2, 3))
    p.access(keys(1, 2, 3))
    p.hint_parent(key(4), key(3))
    assert p.evict(2, keys(4, 5, 6, 7)) == keys(9, 3)
    p.insert(keys(4, 5, 6, 7))
    assert p.lru_order() == keys(7, 6, 5, 4, 2, 1)
    # A parent the run leaves is the anchor, as always.
    q = ChainLRUPolicy(6)
    one_by_one(q, 8, 9)
    q.insert(keys(1, 2, 3))
    q.hint_parent(key(4), key(3))
    assert q.evict(1, keys(4)) == keys(8)
    q.insert(keys(4))
    assert q.lru_order() == keys(9, 4, 3, 2, 1)


def test_chain_lru_hints_are_bounded() -> None:
    p = ChainLRUPolicy(2)
    for i in range(10):
        p.hint_parent(key(100 + i), key(i))
    assert len(p._hints) == 2


def arc_state(p: ARCPolicy) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    return list(p.t1), list(p.t2), list(p.b1), list(p.b2)


def test_arc_ghost_hits_adapt_p() -> None:
    p = ARCPolicy(4)
    one_by_one(p, 1, 2, 3, 4)
    p.access(keys(1, 2))  # used again: T2
    assert arc_state(p) == (keys(3, 4), keys(2, 1), [], [])
    assert p.evict(1, keys(5)) == keys(3)  # |T1| = 2 > p = 0: T1's LRU, remembered in B1
    p.insert(keys(5))
    assert arc_state(p) == (keys(4, 5), keys(2, 1), keys(3), [])
    # A B1 hit grows p, and the key comes back in T2.
    assert p.evict(1, keys(3)) == keys(4)
    assert p.p == 1.0
    p.insert(keys(3))
    assert arc_state(p) == (keys(5), keys(2, 1, 3), keys(4), [])
    # |T1| = 1 is not > p = 1: T2's LRU goes to B2.
    assert p.evict(1, keys(6)) == keys(2)
    p.insert(keys(6))
    assert p.b2 and key(2) in p.b2
    # A B2 hit shrinks p.
    p.evict(1, keys(2))
    assert p.p == 0.0
    p.insert(keys(2))
    assert key(2) in p.t2


def test_arc_p_stays_within_bounds() -> None:
    p = ARCPolicy(3)
    for i in range(200):
        if len(p) == 3:
            victim = p.evict(1, keys(i % 7))
            assert len(victim) == 1
        if key(i % 7) not in p:
            p.insert(keys(i % 7))
        else:
            p.access(keys(i % 7))
        assert 0 <= p.p <= 3


CAPACITY = 5


class PolicyMachine(RuleBasedStateMachine):
    """Any policy: victims are resident and unpinned, counts agree, capacity holds."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: CachePolicy | None = None
        self.resident: set[bytes] = set()
        self.pinned: set[bytes] = set()

    @precondition(lambda self: self.policy is None)
    @rule(name=st.sampled_from(all_policies()))
    def choose(self, name: str | type[CachePolicy]) -> None:
        self.policy = make_policy(name, CAPACITY)

    @precondition(lambda self: self.policy is not None)
    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True))
    def store(self, ids: list[int]) -> None:
        assert self.policy is not None
        new = [key(i) for i in ids if key(i) not in self.resident]
        need = len(new) - (CAPACITY - len(self.resident))
        if need > len(self.resident - self.pinned):
            return
        victims = self.policy.evict(max(need, 0), new)
        assert len(victims) == max(need, 0) == len(set(victims))
        for v in victims:
            assert v in self.resident and v not in self.pinned
            self.resident.remove(v)
        self.policy.insert(new)
        self.resident.update(new)

    @precondition(lambda self: self.policy is not None)
    @rule(ids=st.lists(st.integers(0, 12), max_size=4, unique=True))
    def access(self, ids: list[int]) -> None:
        assert self.policy is not None
        self.policy.access([key(i) for i in ids if key(i) in self.resident])

    @precondition(lambda self: self.policy is not None)
    @rule(ids=st.lists(st.integers(0, 12), max_size=3, unique=True))
    def pin(self, ids: list[int]) -> None:
        assert self.policy is not None
        ks = [key(i) for i in ids if key(i) in self.resident and key(i) not in self.pinned]
        self.policy.pin(ks)
        self.pinned.update(ks)

    @precondition(lambda self: self.policy is not None and self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        assert self.policy is not None
        ks = data.draw(st.lists(st.sampled_from(sorted(self.pinned)), unique=True, min_size=1))
        self.policy.unpin(ks)
        self.pinned.difference_update(ks)

    @invariant()
    def counts_agree(self) -> None:
        p = self.policy
        if p is None:
            return
        assert len(p) == len(self.resident) <= CAPACITY
        assert p.num_evictable() == len(self.resident - self.pinned)
        for i in range(13):
            assert (key(i) in p) == (key(i) in self.resident)
        if isinstance(p, ARCPolicy):
            assert p.n1 + p.n2 == len(p) <= CAPACITY
            # Each ghost list holds <= c after an insert; a store's evict since then
            # moved its victims there from the resident count.
            assert len(p) + max(len(p.b1), len(p.b2)) <= 2 * CAPACITY
            assert 0 <= p.p <= CAPACITY
            assert not (set(p.b1) | set(p.b2)) & self.resident


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- second-sighting admission (arc_admit, lru_admit) -------------------------


def store(policy: CachePolicy, ids: list[int], resident: set[bytes] | None = None) -> list[bytes]:
    """One store of ``ids`` as the manager makes it; the victims."""
    new = [key(i) for i in ids if key(i) not in policy]
    need = max(0, len(new) - (policy.capacity - len(policy)))
    victims = policy.evict(need, new)
    policy.insert(new)
    return victims


@pytest.mark.parametrize("cls", [AdmitARCPolicy, AdmitLRUPolicy])
def test_first_sighting_is_evicted_before_admitted_keys(cls: type[SecondSightPolicy]) -> None:
    p = cls(4)
    store(p, [1, 2])  # first sighting: rejects
    assert list(p.rejects) == keys(2, 1)  # tail first: the head is evicted last
    assert store(p, [3, 4, 5]) == keys(2)
    store(p, [9])  # evicts a reject, 1 then 3...
    # 1 comes back: the history remembers it, so it is admitted to the inner policy.
    store(p, [1])
    assert key(1) in p.inner and key(1) not in p.rejects
    assert p.target == 1.0  # 1 left the rejects too early: they may keep one more key
    store(p, [6, 7])
    assert key(1) in p  # the rejects beyond their share went first


@pytest.mark.parametrize("cls", [AdmitARCPolicy, AdmitLRUPolicy])
def test_a_reject_read_again_is_promoted(cls: type[SecondSightPolicy]) -> None:
    p = cls(8)
    store(p, [1, 2, 3])
    p.access(keys(2))
    assert key(2) in p.inner and key(2) not in p.rejects
    p.pin(keys(3))
    assert key(3) in p.inner and p.num_evictable() == 2
    p.unpin(keys(3))
    assert p.num_evictable() == 3


@pytest.mark.parametrize("cls", [AdmitARCPolicy, AdmitLRUPolicy])
def test_a_reject_named_twice_in_one_access_is_promoted_once(cls: type[SecondSightPolicy]) -> None:
    # (pin gets each key once: the manager pins only keys whose count leaves 0.)
    p = cls(8)
    store(p, [1, 2, 3])
    assert key(2) in p.rejects
    p.access(keys(2, 2))
    assert key(2) in p.inner and key(2) not in p.rejects
    assert len(p) == 3


def test_ghost_hits_move_the_reject_share() -> None:
    p = AdmitLRUPolicy(2)
    store(p, [1, 2])
    store(p, [3, 4])  # 1, 2 leave the rejects: remembered in their ghost
    assert set(p.ghost_rejects) == set(keys(1, 2))
    store(p, [1])
    assert p.target >= 1.0  # the rejects were too short-lived for 1
    assert key(1) in p.inner


@pytest.mark.parametrize("name", all_policies())
def test_clear_forgets_everything(name: str | type[CachePolicy]) -> None:
    p = make_policy(name, 4)
    store(p, [1, 2, 3])
    p.access(keys(1))
    p.clear()
    assert len(p) == 0 and p.num_evictable() == 0 and key(1) not in p
    store(p, [1, 2, 3, 4])
    assert len(p) == 4 and len(store(p, [5])) == 1


class SmallHistory(AdmitARCPolicy):
    name = "arc_admit_small_history"
    min_history = 6
    history_factor = 1


class AdmissionMachine(RuleBasedStateMachine):
    """arc_admit against a reference model of its contract.

    The model: a set of resident keys of at most ``capacity``, a set of pinned
    ones; a store of new keys gets exactly the slots it lacks, its victims are
    resident and unpinned, rejects first (oldest first), and only rejects
    while more rejects than their target share are left. Rejects are never
    pinned; the inner policy and the rejects hold the resident keys between
    them, disjointly; ghosts and history stay within their bounds.
    """

    cls: type[SecondSightPolicy] = SmallHistory

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.cls(CAPACITY)
        self.resident: set[bytes] = set()
        self.pinned: set[bytes] = set()

    @rule(ids=st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True))
    def store(self, ids: list[int]) -> None:
        p = self.policy
        new = [key(i) for i in ids if key(i) not in self.resident]
        need = max(0, len(new) - (CAPACITY - len(self.resident)))
        if need > len(self.resident - self.pinned):
            return
        rejects_before = list(p.rejects)
        victims = p.evict(need, new)
        assert len(victims) == need == len(set(victims))
        for v in victims:
            assert v in self.resident and v not in self.pinned
        # Rejects go first, oldest first; then the inner policy's victims.
        taken = [v for v in victims if v in rejects_before]
        assert victims[: len(taken)] == taken == rejects_before[: len(taken)]
        if len(p.rejects) > p.target:  # rejects beyond their share left first
            assert len(taken) == need
        self.resident.difference_update(victims)
        p.insert(new)
        self.resident.update(new)

    @rule(ids=st.lists(st.integers(0, 15), max_size=4, unique=True))
    def access(self, ids: list[int]) -> None:
        self.policy.access([key(i) for i in ids if key(i) in self.resident])

    @rule(ids=st.lists(st.integers(0, 15), max_size=3, unique=True))
    def pin(self, ids: list[int]) -> None:
        ks = [key(i) for i in ids if key(i) in self.resident and key(i) not in self.pinned]
        self.policy.pin(ks)
        self.pinned.update(ks)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        ks = data.draw(st.lists(st.sampled_from(sorted(self.pinned)), unique=True, min_size=1))
        self.policy.unpin(ks)
        self.pinned.difference_update(ks)

    @precondition(lambda self: not self.pinned)
    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.resident.clear()

    @invariant()
    def model_agrees(self) -> None:
        p = self.policy
        assert len(p) == len(self.resident) <= CAPACITY
        assert p.num_evictable() == len(self.resident - self.pinned)
        for i in range(16):
            assert (key(i) in p) == (key(i) in self.resident)
        rejects = set(p.rejects)
        assert not rejects & self.pinned
        assert rejects.isdisjoint(k for k in self.resident if k in p.inner)
        assert rejects | {k for k in self.resident if k in p.inner} == self.resident
        assert 0 <= p.target <= CAPACITY
        assert len(p.ghost_rejects) <= CAPACITY and len(p.ghost_inner) <= CAPACITY
        assert len(p.history) <= 6
        assert not (set(p.ghost_rejects) | set(p.ghost_inner)) & self.resident


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
