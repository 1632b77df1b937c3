"""ARC and LRU pinned, operation by operation, against plain reference models.

The references are the textbook algorithms with the tier's adaptations
(written with lists, O(n) per step, obviously right); the policies keep flat,
batched structures for speed. After every call the victims, the order of
every list, ``p`` and the counts must agree exactly, so a faster policy that
evicts anything differently fails here.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload.offload.policies import ARCPolicy, FlatLRUPolicy, LRUPolicy, make_policy
from tests.offload.keyutil import key

IDS = 14


class RefLRU:
    """LRU over unpinned keys; a call's keys applied in ``chain_order``."""

    def __init__(self, capacity: int, chain: bool = True) -> None:
        self.chain = chain
        self.order: list[bytes] = []  # unpinned, LRU first
        self.pinned: set[bytes] = set()

    def _ordered(self, keys: Sequence[bytes]) -> list[bytes]:
        return list(reversed(keys)) if self.chain else list(keys)

    def insert(self, keys: Sequence[bytes]) -> None:
        self.order += self._ordered(keys)

    def access(self, keys: Sequence[bytes]) -> None:
        for k in self._ordered(keys):
            if k in self.order:
                self.order.remove(k)
                self.order.append(k)

    def pin(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.order.remove(k)
            self.pinned.add(k)

    def unpin(self, keys: Sequence[bytes]) -> None:
        for k in self._ordered(keys):
            self.pinned.remove(k)
            self.order.append(k)

    def evict(self, n: int, incoming: Sequence[bytes]) -> list[bytes]:
        victims, self.order = self.order[:n], self.order[n:]
        return victims

    def resident(self) -> set[bytes]:
        return set(self.order) | self.pinned


class RefARC:
    """ARC (Megiddo & Modha) with the tier's split of a store into evict and insert.

    ``evict`` adapts ``p`` to every incoming ghost hit first, then runs
    REPLACE once per victim (victim i makes room for ``incoming[-n + i]``);
    ``insert`` puts a key a ghost list remembers in T2, any other in T1, then
    trims each ghost list to its c most recent keys. Pinned keys keep their
    list membership (and count in |T1|, |T2|) but are no candidates; unpinned,
    they return as most recent.
    """

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: list[bytes] = []  # unpinned, LRU first
        self.t2: list[bytes] = []
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.where: dict[bytes, int] = {}
        self.pinned: set[bytes] = set()

    def n(self, which: int) -> int:
        return sum(1 for w in self.where.values() if w == which)

    def _trim(self) -> None:
        # Each ghost list keeps its c most recent keys (vLLM 0.33's bound, not the paper's).
        for ghost in (self.b1, self.b2):
            del ghost[: max(0, len(ghost) - self.c)]

    def insert(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):
            if k in self.b1 or k in self.b2:
                (self.b1 if k in self.b1 else self.b2).remove(k)
                self.where[k] = 2
                self.t2.append(k)
            else:
                self.where[k] = 1
                self.t1.append(k)
        self._trim()

    def access(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):
            if k not in self.pinned:
                (self.t1 if self.where[k] == 1 else self.t2).remove(k)
                self.t2.append(k)
            self.where[k] = 2

    def pin(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            (self.t1 if self.where[k] == 1 else self.t2).remove(k)
            self.pinned.add(k)

    def unpin(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):
            self.pinned.remove(k)
            (self.t1 if self.where[k] == 1 else self.t2).append(k)

    def evict(self, n: int, incoming: Sequence[bytes]) -> list[bytes]:
        in_b2 = []
        for k in incoming:
            if k in self.b1:
                self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            elif k in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            in_b2.append(k in self.b2)
        victims = []
        for i in range(n):
            j = len(incoming) - n + i
            x_in_b2 = j >= 0 and in_b2[j]
            n1 = self.n(1)
            if self.t1 and (not self.t2 or n1 > self.p or (x_in_b2 and n1 == self.p)):
                v = self.t1.pop(0)
                self.b1.append(v)
            else:
                v = self.t2.pop(0)
                self.b2.append(v)
            del self.where[v]
            victims.append(v)
        return victims

    def resident(self) -> set[bytes]:
        return set(self.where)


class ReferenceMachine(RuleBasedStateMachine):
    """A policy and its reference driven alike, within the manager's guarantees."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: LRUPolicy | ARCPolicy = LRUPolicy(1)
        self.ref: RefLRU | RefARC = RefLRU(1)
        self.capacity = 1

    @initialize(name=st.sampled_from(["arc", "lru", FlatLRUPolicy]), capacity=st.integers(1, 6))
    def choose(self, name: str, capacity: int) -> None:
        self.capacity = capacity
        self.policy = make_policy(name, capacity)  # type: ignore[assignment]
        self.ref = RefARC(capacity) if name == "arc" else RefLRU(capacity, name == "lru")

    def _ids(self, ids: list[int]) -> list[bytes]:
        return [key(i) for i in ids]

    @rule(ids=st.lists(st.integers(0, IDS - 1), min_size=1, max_size=6, unique=True))
    def store(self, ids: list[int]) -> None:
        """A prepare_store (one evict, maybe of 0) followed by its insert."""
        resident = self.ref.resident()
        new = [k for k in self._ids(ids) if k not in resident]
        new = new[: self.capacity]
        need = max(0, len(new) - (self.capacity - len(resident)))
        if not new or need > self.policy.num_evictable():
            return
        victims = self.policy.evict(need, new)
        assert victims == self.ref.evict(need, new)
        self.policy.insert(new)
        self.ref.insert(new)

    @rule(ids=st.lists(st.integers(0, IDS - 1), min_size=1, max_size=6, unique=True))
    def failed_store(self, ids: list[int]) -> None:
        """An evict whose store fails: the incoming keys are never inserted."""
        resident = self.ref.resident()
        new = [k for k in self._ids(ids) if k not in resident]
        n = min(len(new), self.policy.num_evictable())
        assert self.policy.evict(n, new) == self.ref.evict(n, new)

    @rule(ids=st.lists(st.integers(0, IDS - 1), max_size=8))
    def access(self, ids: list[int]) -> None:
        """Duplicates allowed: a touch passes the caller's keys through."""
        resident = self.ref.resident()
        ks = [k for k in self._ids(ids) if k in resident]
        self.policy.access(ks)
        self.ref.access(ks)

    @rule(ids=st.lists(st.integers(0, IDS - 1), max_size=6, unique=True))
    def load(self, ids: list[int]) -> None:
        """prepare_load + complete_load: pin the unpinned ones, access all, unpin."""
        resident = self.ref.resident()
        ks = [k for k in self._ids(ids) if k in resident]
        fresh = [k for k in ks if k not in self.ref.pinned]
        self.policy.pin(fresh)
        self.ref.pin(fresh)
        self.policy.access(ks)
        self.ref.access(ks)
        self.policy.unpin(fresh)
        self.ref.unpin(fresh)

    @rule(ids=st.lists(st.integers(0, IDS - 1), max_size=4, unique=True))
    def pin(self, ids: list[int]) -> None:
        resident = self.ref.resident()
        ks = [k for k in self._ids(ids) if k in resident and k not in self.ref.pinned]
        self.policy.pin(ks)
        self.ref.pin(ks)

    @precondition(lambda self: self.ref.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        ks = data.draw(st.lists(st.sampled_from(sorted(self.ref.pinned)), unique=True, min_size=1))
        self.policy.unpin(ks)
        self.ref.unpin(ks)

    @invariant()
    def same_state(self) -> None:
        p, ref = self.policy, self.ref
        resident = ref.resident()
        assert len(p) == len(resident)
        assert p.num_evictable() == len(resident - ref.pinned)
        for i in range(IDS):
            assert (key(i) in p) == (key(i) in resident)
        if isinstance(p, ARCPolicy):
            assert isinstance(ref, RefARC)
            assert (list(p.t1), list(p.t2)) == (ref.t1, ref.t2)
            assert (list(p.b1), list(p.b2)) == (ref.b1, ref.b2)
            assert p.p == ref.p
            assert (p.n1, p.n2) == (ref.n(1), ref.n(2))
        else:
            assert isinstance(ref, RefLRU)
            assert p.lru_order() == ref.order


TestReferenceMachine = ReferenceMachine.TestCase
TestReferenceMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_flat_lru_is_the_chain_unaware_one() -> None:
    assert isinstance(make_policy(FlatLRUPolicy, 2), FlatLRUPolicy)
    assert FlatLRUPolicy.chain_order([key(1), key(2)]) == [key(1), key(2)]


def test_arc_remembers_a_full_tier_of_t1_ghosts() -> None:
    # The paper's |T1| + |B1| <= c would forget both ghosts here; each list keeps c.
    arc = ARCPolicy(2)

    def store(i: int) -> None:
        arc.evict(max(0, len(arc) + 1 - arc.capacity), [key(i)])
        arc.insert([key(i)])

    for i in range(4):
        store(i)
    assert list(arc.t1) == [key(2), key(3)]
    assert list(arc.b1) == [key(0), key(1)]
    store(0)  # a returning ghost comes back as used again, and T1's target grows
    assert key(0) in arc.t2 and arc.p > 0
