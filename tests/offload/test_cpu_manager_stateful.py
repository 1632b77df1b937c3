"""CPUOffloadingManager against a reference model, for every policy.

The model tracks which keys are stored, storing and pinned, which slot each
holds, and the events that must come out. For ``lru`` and ``lru_flat`` it also
predicts the exact victims from last-use ticks (a call's keys are used tail
first for ``lru``, in the given order for ``lru_flat``; a load's use is its
completion; the stored keys of a store that needs eviction are used by it).
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvoffload.offload import CPUOffloadingManager, OffloadingEvent, OffloadKey
from kvoffload.offload.policies import FlatLRUPolicy, all_policies, make_policy
from kvoffload.offload.policies.admission import SecondSightPolicy
from tests.offload.keyutil import key

N = 4
UNIVERSE = 9
# Often with a key named twice in one call: a request may name a block twice,
# and a policy once raised KeyError on touch([k, k]).
ids_list = st.lists(st.integers(0, UNIVERSE - 1), max_size=5) | st.lists(
    st.integers(0, UNIVERSE - 1), min_size=1, max_size=3
).flatmap(lambda ids: st.permutations(ids * 2))


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: CPUOffloadingManager
        self.policy = ""
        self.stored: dict[OffloadKey, int] = {}
        self.storing: dict[OffloadKey, int] = {}
        self.pins: Counter[OffloadKey] = Counter()
        self.loads: list[list[OffloadKey]] = []
        self.stores: list[tuple[list[OffloadKey], list[OffloadKey]]] = []  # (new, given)
        self.events: list[OffloadingEvent] = []
        self.last_used: dict[OffloadKey, int] = {}
        self.tick = 0

    @initialize(policy=st.sampled_from(all_policies()))
    def start(self, policy: str) -> None:
        self.policy = policy
        self.m = CPUOffloadingManager(N, policy, enable_events=True)

    # -- LRU model ------------------------------------------------------------

    @property
    def exact(self) -> bool:
        return self.policy in ("lru", FlatLRUPolicy)

    def use(self, keys: list[OffloadKey]) -> None:
        for k in keys[::-1] if self.policy == "lru" else keys:
            self.tick += 1
            self.last_used[k] = self.tick

    # -- rules ----------------------------------------------------------------

    @rule(ids=ids_list)
    def lookup(self, ids: list[int]) -> None:
        ks = [key(i) for i in ids]
        expected = 0
        for k in ks:
            if k not in self.stored:
                break
            expected += 1
        assert self.m.lookup(ks) == expected

    @precondition(lambda self: self.stored)
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ks = data.draw(st.lists(st.sampled_from(sorted(self.stored)), min_size=1, max_size=4))
        spec = self.m.prepare_load(ks)
        assert spec.medium() == "CPU"
        assert spec.block_ids.tolist() == [self.stored[k] for k in ks]
        self.pins.update(ks)
        self.loads.append(ks)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        ks = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(ks)
        unpinned = []
        for k in ks:
            self.pins[k] -= 1
            if self.pins[k] == 0:
                del self.pins[k]
                unpinned.append(k)
        self.use(unpinned)

    @rule(ids=ids_list)
    def touch(self, ids: list[int]) -> None:
        ks = [key(i) for i in ids]
        self.m.touch(ks)
        self.use([k for k in ks if k in self.stored and k not in self.pins])

    @precondition(lambda self: self.stored)
    @rule(data=st.data())
    def touch_stored_repeating(self, data: st.DataObject) -> None:
        """A touch naming stored keys, one of them twice or more."""
        some = st.lists(st.sampled_from(sorted(self.stored)), min_size=1, max_size=3)
        ks = data.draw(some.flatmap(lambda ks: st.permutations(ks * 2)))
        self.m.touch(ks)
        self.use([k for k in ks if k not in self.pins])

    @rule(ids=ids_list)
    def prepare_store(self, ids: list[int]) -> None:
        ks = [key(i) for i in ids]
        unique = list(dict.fromkeys(ks))
        new = [k for k in unique if k not in self.stored and k not in self.storing]
        free = N - len(self.stored) - len(self.storing)
        need = len(new) - free
        protect = [k for k in unique if k in self.stored and k not in self.pins]
        candidates = [k for k in self.stored if k not in self.pins and k not in protect]
        out = self.m.prepare_store(ks)
        if new and need > len(candidates):
            assert out is None
            return  # the invariants check that nothing changed
        assert out is not None
        assert out.keys_to_store == new
        evicted = out.evicted_keys
        assert len(evicted) == max(need, 0) == len(set(evicted))
        assert set(evicted) <= set(candidates)
        if self.exact:
            expected = sorted(candidates, key=lambda k: self.last_used[k])[: max(need, 0)]
            assert evicted == expected
        assert out.evicted_spec is not None
        assert out.evicted_spec.block_ids.tolist() == [self.stored[k] for k in evicted]
        if need > 0:
            self.use(protect)
        for k in evicted:
            del self.stored[k]
            self.last_used.pop(k, None)
        if evicted:
            self.events.append(OffloadingEvent(evicted, "CPU", removed=True))
        slots = out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
        assert out.store_spec.medium() == "CPU" and len(slots) == len(new)
        live = set(self.stored.values()) | set(self.storing.values())
        assert len(set(slots)) == len(slots) and not set(slots) & live
        assert all(0 <= s < N for s in slots)
        for k, s in zip(new, slots):
            self.storing[k] = s
        if new:
            self.stores.append((new, ks))

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans(), as_given=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool, as_given: bool) -> None:
        """Complete with ``keys_to_store`` or with the very keys given to ``prepare_store``.

        Either way only the keys being stored change (vLLM 0.33's contract);
        with the given keys, that includes keys another store had in flight.
        """
        new, given = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        ks = given if as_given else new
        self.m.complete_store(ks, success=success)
        done = [k for k in dict.fromkeys(ks) if k in self.storing]
        for k in done:
            slot = self.storing.pop(k)
            if success:
                self.stored[k] = slot
        if success and done:
            self.use(done)
            self.events.append(OffloadingEvent(done, "CPU", removed=False))

    @rule(force=st.booleans())
    def reset_cache(self, force: bool) -> None:
        busy = bool(self.storing or self.pins)
        ok = self.m.reset_cache(force=force)
        assert ok == (force or not busy)
        if not ok:
            return  # the invariants check that nothing changed
        events = self.m.take_events()
        if self.stored:
            assert len(events) == 1 and events[0].removed and events[0].medium == "CPU"
            assert sorted(events[0].keys) == sorted(self.stored)
        else:
            assert events == []
        # A forced reset: the caller never completes jobs prepared before it.
        self.stored.clear()
        self.storing.clear()
        self.pins.clear()
        self.loads.clear()
        self.stores.clear()
        self.last_used.clear()

    @rule(i=st.integers(0, UNIVERSE - 1))
    def bad_calls_raise_and_change_nothing(self, i: int) -> None:
        k = key(i)
        if k not in self.stored:
            try:
                self.m.prepare_load([k])
            except ValueError:
                pass
            else:
                raise AssertionError("prepare_load of a key not stored")
        if k not in self.storing:
            self.m.complete_store([k])  # ignored (vLLM 0.33)
            self.m.complete_store([k], success=False)
        if self.pins[k] == 0:
            try:
                self.m.complete_load([k])
            except ValueError:
                pass
            else:
                raise AssertionError("complete_load of a key not pinned")

    # -- invariants -----------------------------------------------------------

    @invariant()
    def state_agrees(self) -> None:
        if not self.policy:
            return
        m = self.m
        assert m.num_free_blocks() == N - len(self.stored) - len(self.storing)
        assert m.num_stored_blocks() == len(self.stored)
        assert m.num_evictable_blocks() == len([k for k in self.stored if k not in self.pins])
        for i in range(UNIVERSE):
            k = key(i)
            assert m.is_stored(k) == (k in self.stored)
            assert m.is_storing(k) == (k in self.storing)
            assert m.ref_count(k) == self.pins.get(k, 0)
            assert m.slot_of(k) == self.stored.get(k, self.storing.get(k))

    @invariant()
    def events_agree(self) -> None:
        if not self.policy:
            return
        assert self.m.take_events() == self.events
        self.events = []


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class LRUManagerMachine(ManagerMachine):
    """The same machine on the two policies whose victims the model predicts exactly."""

    @initialize(policy=st.sampled_from(["lru", FlatLRUPolicy]))
    def start(self, policy: str) -> None:
        super().start(policy)


TestLRUManagerMachine = LRUManagerMachine.TestCase
TestLRUManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


#: Policies with second-sighting admission: first-sighting keys sit in a reject
#: queue until read again, a path of their own for repeated keys.
ADMISSION = [n for n in all_policies() if isinstance(make_policy(n, N), SecondSightPolicy)]


class AdmissionManagerMachine(ManagerMachine):
    """The same machine on the admission policies only."""

    @initialize(policy=st.sampled_from(ADMISSION))
    def start(self, policy: str) -> None:
        super().start(policy)


TestAdmissionManagerMachine = AdmissionManagerMachine.TestCase
TestAdmissionManagerMachine.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
