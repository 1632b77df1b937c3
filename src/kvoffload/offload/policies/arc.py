"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), adapted to a tier.

Resident keys live in T1 (seen once since they came in) or T2 (used again);
the ghost lists B1 and B2 remember, keys only, what was recently evicted from
each. A store of a key remembered in B1 means T1 was too small: the target
size ``p`` of T1 grows; one remembered in B2 shrinks it. Eviction takes T1's
LRU while T1 is larger than ``p``, T2's otherwise.

Adaptations to the tier's protocol: a store is split into ``evict`` (room is
made and ``p`` adapts, at prepare time) and ``insert`` (the key becomes
resident in T2 if a ghost list still remembers it, in T1 otherwise, at
completion). Pinned keys keep their T1/T2 membership (and count in the
sizes) but leave the LRU lists, so eviction never has to skip them.

Invariants (with c = capacity): |T1| + |T2| <= c, |T1| + |B1| <= c,
|T1| + |T2| + |B1| + |B2| <= 2c, 0 <= p <= c.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import compress, repeat, starmap
from operator import itemgetter, not_, or_

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy

T1, T2 = 1, 2
_MISSING = object()
# Speed: a store or load moves whole runs of keys, so the per-key work is done
# by C loops (map / starmap drained by a zero-length deque) rather than by
# Python bytecode per key. Every fast path below does exactly what the plain
# per-key loop beside it does (tests/offload/test_arc_lru_reference.py).
_drain = deque(maxlen=0).extend
_first = itemgetter(0)
_FRONT = (False,)  # popitem(last=False): the LRU end


def _pop_front(od: OrderedDict[OffloadKey, None], k: int) -> list[OffloadKey]:
    """Remove and return the ``k`` oldest keys of ``od``."""
    return list(map(_first, starmap(od.popitem, repeat(_FRONT, k))))


def _drop_front(od: OrderedDict[OffloadKey, None], k: int) -> None:
    _drain(starmap(od.popitem, repeat(_FRONT, k)))


def _drop_keys(od: OrderedDict[OffloadKey, None], keys: Iterable[OffloadKey]) -> None:
    """Remove ``keys`` from ``od`` where present."""
    _drain(map(od.pop, keys, repeat(None)))


class ARCPolicy(CachePolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p: float = 0.0
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()  # unpinned, LRU first
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._list_of: dict[OffloadKey, int] = {}  # every resident key -> T1 or T2
        self._pinned: set[OffloadKey] = set()
        self.n1 = 0  # |T1|, pinned included
        self.n2 = 0

    def __len__(self) -> int:
        return len(self._list_of)

    def __contains__(self, key: object) -> bool:
        return key in self._list_of

    def num_evictable(self) -> int:
        return len(self.t1) + len(self.t2)

    def _trim_ghosts(self) -> None:
        c = self.capacity
        b1, b2 = self.b1, self.b2
        n1 = self.n1
        k1 = min(len(b1), n1 + len(b1) - c)
        if k1 > 0:
            _drop_front(b1, k1)
        over = n1 + self.n2 + len(b1) + len(b2) - 2 * c
        if over > 0:
            k = min(over, len(b2))
            _drop_front(b2, k)
            if over > k:
                _drop_front(b1, over - k)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        order = self.chain_order(keys)
        t1, list_of = self.t1, self._list_of
        # Forget each key in the ghost lists; True where one remembered it (ghosts hold True).
        absent = repeat(False)
        ghosted = list(map(or_, map(self.b1.pop, order, absent), map(self.b2.pop, order, absent)))
        if True not in ghosted:
            t1.update(dict.fromkeys(order))
            list_of.update(dict.fromkeys(order, T1))
            self.n1 += len(order)
        else:
            to_t1 = list(compress(order, map(not_, ghosted)))
            to_t2 = list(compress(order, ghosted))
            t1.update(dict.fromkeys(to_t1))
            self.t2.update(dict.fromkeys(to_t2))
            list_of.update(dict.fromkeys(to_t1, T1))
            list_of.update(dict.fromkeys(to_t2, T2))
            self.n1 += len(to_t1)
            self.n2 += len(to_t2)
        self._trim_ghosts()

    def access(self, keys: Sequence[OffloadKey]) -> None:
        order = self.chain_order(keys)
        list_of, pinned = self._list_of, self._pinned
        unique = dict.fromkeys(order)
        if pinned.issuperset(unique):
            # A load: every key pinned, only T1 -> T2 membership changes.
            moved = list(map(list_of.__getitem__, unique)).count(T1)
            list_of.update(dict.fromkeys(unique, T2))
        elif len(unique) == len(order) and pinned.isdisjoint(unique):
            # A touch of distinct unpinned keys: each leaves its list for T2's MRU end.
            moved = list(map(list_of.__getitem__, unique)).count(T1)
            _drop_keys(self.t1, unique)
            _drop_keys(self.t2, unique)
            self.t2.update(unique)
            list_of.update(dict.fromkeys(unique, T2))
        else:
            moved = 0
            t1, t2 = self.t1, self.t2
            for key in order:
                where = list_of[key]
                if key in pinned:
                    if where == T1:
                        list_of[key] = T2
                        moved += 1
                    continue
                if where == T1:
                    del t1[key]
                    list_of[key] = T2
                    moved += 1
                    t2[key] = None
                else:
                    t2.move_to_end(key)
        self.n1 -= moved
        self.n2 += moved

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        # An unpinned resident key is in exactly one of T1, T2.
        _drop_keys(self.t1, keys)
        _drop_keys(self.t2, keys)
        self._pinned.update(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        order = self.chain_order(keys)
        list_of = self._list_of
        self._pinned.difference_update(order)
        lists = list(map(list_of.__getitem__, order))
        if T1 not in lists:
            self.t2.update(dict.fromkeys(order))
        elif T2 not in lists:
            self.t1.update(dict.fromkeys(order))
        else:
            t1, t2 = self.t1, self.t2
            for key, where in zip(order, lists):
                (t1 if where == T1 else t2)[key] = None

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        b1, b2 = self.b1, self.b2
        in_b2: list[bool] | None = None
        hit1 = list(map(b1.__contains__, incoming))
        hit2 = list(map(b2.__contains__, incoming))
        c1, c2 = hit1.count(True), hit2.count(True)
        if c1 or c2:
            # Ghost hits move p (ARC's adaptation), one incoming key at a time; the
            # step sizes are fixed within the call (the ghost lists do not change).
            p, cap = self.p, float(self.capacity)
            up = max(len(b2) / len(b1), 1.0) if c1 else 0.0
            down = max(len(b1) / len(b2), 1.0) if c2 else 0.0
            if not c2:
                for _ in range(c1):
                    p = min(cap, p + up)
            elif not c1:
                for _ in range(c2):
                    p = max(0.0, p - down)
            else:
                for in1, in2 in zip(hit1, hit2):
                    if in1:
                        p = min(cap, p + up)
                    elif in2:
                        p = max(0.0, p - down)
            self.p = p
            in_b2 = hit2  # B1 and B2 never share a key
        if n == 0:
            return []  # nothing left the tier: the ghost bounds still hold
        p = self.p
        t1, t2, list_of = self.t1, self.t2, self._list_of
        n1, n2 = self.n1, self.n2
        off = len(incoming) - n
        victims: list[OffloadKey] = []
        i = 0
        while i < n:
            # Room for incoming[-n + i]: ARC's REPLACE with that key's B2 flag. Runs of
            # victims from one list are taken together where the rule cannot change
            # within the run (T1 while |T1| > p, T2 while |T1| < p or T1 is empty).
            if t1 and (not t2 or n1 > p):
                k = min(n - i, len(t1), math.ceil(n1 - p)) if t2 else min(n - i, len(t1))
                run = _pop_front(t1, k)
                n1 -= k
                ghost = b1
            elif t2 and (not t1 or n1 < p):
                k = min(n - i, len(t2))
                run = _pop_front(t2, k)
                n2 -= k
                ghost = b2
            else:  # |T1| == p: the incoming key's B2 flag decides, one victim
                j = off + i
                if in_b2 is not None and j >= 0 and in_b2[j]:
                    run = _pop_front(t1, 1)
                    n1 -= 1
                    ghost = b1
                else:
                    run = _pop_front(t2, 1)
                    n2 -= 1
                    ghost = b2
                k = 1
            ghost.update(dict.fromkeys(run, True))
            _drain(map(list_of.__delitem__, run))
            victims += run
            i += k
        self.n1, self.n2 = n1, n2
        self._trim_ghosts()
        return victims
