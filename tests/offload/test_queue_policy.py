"""The queue-aware default (``queue_arms``) and its inner ``chain_arms``, against a reference model.

The model knows only the contract: which requests wait (in queue order) and
which keys each needs. From it follow the properties checked on every store:
a key some waiting request needs is evicted only once no other evictable key
is left, and then the one needed farthest ahead goes first; a dequeued
request's keys are no longer protected. Hints are also checked to cost no
scan of the stored blocks (Python line events counted, not time), and the
loop shape to keep part of its working set.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvoffload.bench.policy.replay import belady_hit_rate, replay
from kvoffload.bench.policy.traces import LOOP_CAPACITY, generate, trace_keys, trace_times
from kvoffload.offload import CPUOffloadingManager, OffloadKey
from kvoffload.offload.policies.default.arms import BIP, ArmsChainLRUPolicy
from kvoffload.offload.policies.default.policy_duel import PolicyDuel
from kvoffload.offload.policies.default.queue import QueueArmsPolicy, QueueAwarePolicy
from tests.offload.keyutil import key, keys


def store(m: CPUOffloadingManager, ks: Sequence[OffloadKey]) -> list[OffloadKey]:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store, success=True)
    return out.evicted_keys


def policy_of(m: CPUOffloadingManager) -> QueueAwarePolicy:
    assert isinstance(m.policy, QueueAwarePolicy)
    return m.policy


# -- unit behaviour ------------------------------------------------------------------------


def test_a_hinted_block_outlives_every_unhinted_one_and_is_released_on_dequeue() -> None:
    m = CPUOffloadingManager(4, "queue_arms")
    store(m, keys(1, 2, 3, 4))
    m.hint_queued("r", keys(2))
    assert policy_of(m).is_held(key(2))
    evicted: list[OffloadKey] = []
    for i in range(10, 20):
        evicted += store(m, keys(i))
    assert key(2) not in evicted and m.is_stored(key(2))
    assert {key(1), key(3), key(4)} <= set(evicted)
    m.hint_dequeued("r")
    assert not policy_of(m).is_held(key(2))
    # Released: an ordinary key again, which a store needing every slot may take.
    assert key(2) in store(m, keys(40, 41, 42, 43))


def test_when_full_of_needed_keys_the_farthest_need_goes_first() -> None:
    m = CPUOffloadingManager(3, "queue_arms")
    store(m, keys(1))
    store(m, keys(2))
    store(m, keys(3))
    m.hint_queued("a", keys(1))  # needed first
    m.hint_queued("b", keys(2))
    m.hint_queued("c", keys(3))  # needed last
    assert store(m, keys(9)) == keys(3)
    m.hint_queued("d", keys(9))
    assert store(m, keys(8)) == keys(9)  # d waits behind b: 9 is needed after 2


def test_within_one_request_the_tail_goes_before_the_head() -> None:
    m = CPUOffloadingManager(3, "queue_arms")
    store(m, keys(1, 2, 3))
    m.hint_queued("a", keys(1, 2, 3))
    assert store(m, keys(7)) == keys(3)
    assert store(m, keys(8, 9)) == keys(7, 2)  # the unneeded 7 first, then the tail


def test_a_store_does_not_push_out_its_own_queued_head_for_its_tail() -> None:
    # The request comes back (queued again) for all five blocks; three are stored and
    # held. Its tail 4, 5 could only come in by evicting 3 and 2, which the same
    # request reads first: Belady keeps the head and does not store the tail.
    m = CPUOffloadingManager(3, "queue_arms")
    store(m, keys(1, 2, 3))
    m.hint_queued("again", keys(1, 2, 3, 4, 5))
    assert m.admit(keys(4, 5)) == [False, False]
    assert m.lookup(keys(1, 2, 3, 4, 5)) == 3


def test_the_bypass_holds_when_the_inner_policy_stores_everything() -> None:
    # BIP admits a store whole (None) even beyond the room its own keys leave.
    m = CPUOffloadingManager(3, "queue_arms")
    store(m, keys(1, 2, 3))
    m.hint_queued("again", keys(1, 2, 3, 4, 5))
    policy_of(m).inner.admit = lambda ks, in_flight=0: None  # type: ignore[method-assign]
    assert m.admit(keys(4, 5)) == [False, False]
    m.hint_queued("soon", keys(6))  # after "again": needed later than 1, 2, 3
    assert m.admit(keys(6)) == [False]


def test_a_key_needed_sooner_than_a_held_one_still_comes_in() -> None:
    m = CPUOffloadingManager(2, "queue_arms")
    store(m, keys(1, 2))
    m.hint_queued("first", keys(7))
    m.hint_queued("last", keys(1, 2))
    assert m.admit(keys(7)) in (None, [True])  # 7 is read before 2: 2 goes
    assert store(m, keys(7)) == keys(2)
    m.hint_queued("later", keys(8))
    assert m.admit(keys(8)) == [False]  # every held key is needed before 8


def test_a_key_queued_before_it_is_stored_is_held_once_stored() -> None:
    m = CPUOffloadingManager(2, "queue_arms")
    m.hint_queued("a", keys(5))
    store(m, keys(5))
    assert policy_of(m).is_held(key(5))
    for i in range(10, 16):
        assert key(5) not in store(m, keys(i))


def test_the_same_key_in_two_requests_is_held_until_both_leave() -> None:
    m = CPUOffloadingManager(2, "queue_arms")
    store(m, keys(1))
    m.hint_queued("a", keys(1))
    m.hint_queued("b", keys(1))
    m.hint_dequeued("a")
    assert policy_of(m).is_held(key(1))
    m.hint_dequeued("b")
    assert not policy_of(m).is_held(key(1))
    m.hint_dequeued("b")  # again: ignored


def test_requeueing_an_id_replaces_its_keys() -> None:
    m = CPUOffloadingManager(4, "queue_arms")
    store(m, keys(1, 2))
    m.hint_queued("a", keys(1))
    m.hint_queued("a", keys(2))
    p = policy_of(m)
    assert p.is_held(key(2)) and not p.is_held(key(1))


def test_pinned_held_keys_are_not_evictable_and_loads_still_work() -> None:
    m = CPUOffloadingManager(2, "queue_arms")
    store(m, keys(1, 2))
    m.hint_queued("a", keys(1, 2))
    m.prepare_load(keys(1))
    assert m.num_evictable_blocks() == 1
    assert store(m, keys(3)) == keys(2)
    assert m.prepare_store(keys(4, 5)) is None  # 1 is pinned, 3 is being... stored: no room
    m.complete_load(keys(1))
    assert m.num_evictable_blocks() == 2


def test_continue_marks_are_a_soft_priority() -> None:
    m = CPUOffloadingManager(4, "queue_arms")
    store(m, keys(1, 2, 3, 4))
    m.hint_continues(keys(1))
    m.hint_queued("q", keys(2))
    evicted: list[OffloadKey] = []
    evicted += store(m, keys(10, 11))
    assert key(1) not in evicted and key(2) not in evicted
    # Three slots needed, two unmarked and unheld keys: the mark gives way, the hold does not.
    assert set(store(m, keys(12, 13, 14))) == {key(10), key(11), key(1)}


def test_a_continue_mark_outlives_the_queued_request_that_also_held_the_key() -> None:
    # 2 is held for "q" when its conversation is marked as continuing; "q" leaving the
    # queue ends the hold, not the mark: 2 stays protected over the unmarked keys.
    m = CPUOffloadingManager(4, "queue_arms")
    store(m, keys(1, 2, 3, 4))
    m.hint_queued("q", keys(2))
    m.hint_continues(keys(2))
    m.hint_dequeued("q")
    p = policy_of(m)
    assert not p.is_held(key(2)) and key(2) in p._marked
    for k in (1, 3, 4):  # 2 becomes the least recent key: only its mark keeps it
        m.touch(keys(k))
    assert store(m, keys(10)) == keys(1)
    assert key(2) not in store(m, keys(11, 12))


def test_continue_marks_keep_at_most_half_the_tier() -> None:
    p = QueueArmsPolicy(8)
    p.insert(keys(*range(8)))
    p.hint_continues(keys(*range(8)))
    assert len(p._marked) == 4  # the oldest marks went back to the inner policy
    assert len(p) == 8 and p.num_evictable() == 8


def test_without_hints_it_is_its_inner_policy() -> None:
    trace = trace_keys(generate("mixed", 200, seed=4))
    for cap in (40, 400):
        a = replay(trace, "queue_arms", cap)
        b = replay(trace, PolicyDuel, cap)
        assert a.hit_blocks == b.hit_blocks


# -- hints cost no scan ---------------------------------------------------------------------


def _line_events(fn: Callable[[], None]) -> int:
    count = 0

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _hint_cost(stored: int) -> int:
    m = CPUOffloadingManager(stored, "queue_arms")
    for i in range(0, stored, 50):
        store(m, keys(*range(i, min(i + 50, stored))))
    m.hint_queued("warm", keys(0, 1, 2))
    m.hint_dequeued("warm")
    want = keys(3, 4, 5, stored + 1)

    def hints() -> None:
        m.hint_queued("r", want)
        m.hint_continues(keys(7))
        m.hint_dequeued("r")

    return _line_events(hints)


def test_hints_cost_about_the_same_for_a_tier_100_times_larger() -> None:
    small, large = _hint_cost(100), _hint_cost(10_000)
    assert small > 0
    # The inner policy's state differs a little between the two; a scan of 10,000
    # stored keys would cost at least 10,000 line events.
    assert large < 2 * small + 100 and large < 2_000


def test_a_store_with_held_keys_does_not_scan_them() -> None:
    def cost(held: int) -> int:
        m = CPUOffloadingManager(held + 1, "queue_arms")
        store(m, keys(*range(held + 1)))
        m.hint_queued("r", keys(*range(held)))  # all but one held
        # Warm: two slots, one unheld key: a held one goes too (the heap catches up
        # with the hints here, once: amortised against them).
        assert len(set(store(m, keys(10**6, 10**6 + 1))) & set(keys(*range(held)))) == 1
        victims: list[OffloadKey] = []

        def measured() -> None:
            # Three slots: the two keys of the warm store (unheld), then one held key.
            victims.extend(store(m, keys(10**6 + 2, 10**6 + 3, 10**6 + 4)))

        n = _line_events(measured)
        assert len(set(victims) & set(keys(*range(held)))) == 1  # a held key went
        return n

    assert cost(10_000) <= cost(100) + 40  # a heap pop or two more, not a scan


# -- loops ----------------------------------------------------------------------------------


def test_a_loop_twice_the_tier_keeps_half_of_beladys_hits() -> None:
    trace = trace_keys(generate("loop", 400, seed=0))
    unique = len({k for t in trace for k in t})
    cap = round(unique * float(LOOP_CAPACITY.rstrip("%")) / 100)
    bound = belady_hit_rate(trace, cap)
    assert replay(trace, "lru", cap).hit_rate == 0.0
    for name in ("chain_arms", "queue_arms"):
        assert replay(trace, name, cap).hit_rate >= 0.5 * bound, name


def test_a_fully_queued_loop_is_served_as_beladys_min_serves_it() -> None:
    # Every turn of the loop is known 5 s ahead (about 50 requests): each store would
    # otherwise evict its own stored head to fit its tail (74% of Belady's hits).
    reqs = generate("loop", 400, seed=0)
    trace = trace_keys(reqs)
    unique = len({k for t in trace for k in t})
    cap = round(unique * float(LOOP_CAPACITY.rstrip("%")) / 100)
    bound = belady_hit_rate(trace, cap)
    hinted = replay(trace, "queue_arms", cap, trace_times(reqs), 5000.0)
    assert hinted.hit_rate >= 0.95 * bound


def test_a_loop_switches_chain_arms_to_bip() -> None:
    m = CPUOffloadingManager(60, "chain_arms")
    prompts = [keys(*range(100 * p, 100 * p + 30)) for p in range(4)]  # 120 blocks in turn
    for _ in range(20):
        for ks in prompts:
            hit = m.lookup(ks)
            if hit:
                m.prepare_load(ks[:hit])
                m.complete_load(ks[:hit])
            store(m, ks[hit:])
    assert isinstance(m.policy, ArmsChainLRUPolicy) and m.policy.mode == BIP


# -- against a reference model ---------------------------------------------------------------


class QueueModel(RuleBasedStateMachine):
    """Random stores, loads and queue hints on a small tier; properties from the model."""

    CAP = 6

    def __init__(self) -> None:
        super().__init__()
        self.m = CPUOffloadingManager(self.CAP, "queue_arms")
        self.queue: dict[str, tuple[int, list[OffloadKey]]] = {}  # id -> (seq, unique keys)
        self.seq = 0
        self.next_id = 0

    def rank(self, k: OffloadKey) -> tuple[int, int] | None:
        """(queue seq, position) of the nearest waiting request needing ``k``."""
        best = None
        for seq, ks in self.queue.values():
            if k in ks:
                r = (seq, ks.index(k))
                best = r if best is None or r < best else best
        return best

    def stored(self) -> set[OffloadKey]:
        return {k for k in map(key, range(20)) if self.m.is_stored(k)}

    @rule(ids=st.lists(st.integers(0, 19), min_size=1, max_size=4, unique=True))
    def store_keys(self, ids: list[int]) -> None:
        ks = keys(*ids)
        before = self.stored()
        out = self.m.prepare_store(ks)
        if out is None:
            return
        self.m.complete_store(out.keys_to_store, success=True)
        evicted = set(out.evicted_keys)
        # Candidates the store could have taken (its own stored keys are protected).
        free = before - set(ks)
        needed = {k for k in free if self.rank(k) is not None}
        unneeded = free - needed
        taken_needed = evicted & needed
        if taken_needed:
            assert unneeded <= evicted, "a needed key went while an unneeded one stayed"
            kept = needed - evicted
            if kept:
                lowest_taken = min(self.rank(k) for k in taken_needed)  # type: ignore[type-var]
                highest_kept = max(self.rank(k) for k in kept)  # type: ignore[type-var]
                assert lowest_taken > highest_kept, "a nearer need went before a farther one"

    @rule(ids=st.lists(st.integers(0, 19), min_size=1, max_size=5))
    def queue_request(self, ids: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        ks = keys(*ids)
        self.m.hint_queued(rid, ks)
        self.queue[rid] = (self.seq, list(dict.fromkeys(ks)))
        self.seq += 1

    @rule(pick=st.integers(0, 7))
    def dequeue_request(self, pick: int) -> None:
        if not self.queue:
            self.m.hint_dequeued("nobody")
            return
        rid = sorted(self.queue)[pick % len(self.queue)]
        del self.queue[rid]
        self.m.hint_dequeued(rid)

    @rule(ids=st.lists(st.integers(0, 19), min_size=1, max_size=4, unique=True))
    def load(self, ids: list[int]) -> None:
        ks = keys(*ids)
        hit = self.m.lookup(ks)
        if hit:
            self.m.prepare_load(ks[:hit])
            self.m.complete_load(ks[:hit])
        self.m.touch(ks)

    @rule(ids=st.lists(st.integers(0, 19), min_size=1, max_size=3, unique=True))
    def continues(self, ids: list[int]) -> None:
        self.m.hint_continues(keys(*ids))

    @invariant()
    def held_is_exactly_the_needed_stored_keys(self) -> None:
        p = policy_of(self.m)
        for k in self.stored():
            assert p.is_held(k) == (self.rank(k) is not None)
        assert len(p) == len(self.stored())
        assert p.num_evictable() == len(self.stored())  # nothing pinned between rules


TestQueueModel = QueueModel.TestCase
TestQueueModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
