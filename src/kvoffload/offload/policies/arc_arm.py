"""ARC as one arm of the policy duel: ``arc``'s rule, plus what switching into and out of it needs.

The replacement rule is ARC's (Megiddo & Modha, FAST 2003), as the tier's
``arc`` applies it: resident keys are in T1 (seen once since they came in) or
T2 (read again); ghost lists B1 / B2 remember keys recently evicted from
each; a store of a key that B1 remembers grows T1's target share ``p``, one
that B2 remembers shrinks it; eviction takes T1's least recent while T1 is
larger than ``p``, T2's otherwise. One call's keys are applied tail first
(``chain_order``), so a chain's head ends up the most recent.

What this class adds for ``PolicyDuel`` (which moves the resident keys from
one arm's structure to the other's when the duel changes its mind):
``discard`` (forget one resident key, pinned or not: the queue wrapper evicts
protected keys by name), ``export`` (the unpinned keys in their lists'
orders) and ``load`` (start from given T1 / T2 contents and pins).

Invariants (c = capacity): |T1| + |T2| <= c (the manager's slots);
|T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c after every insert;
0 <= p <= c; a pinned key keeps its list label (and counts in n1 / n2) but is
in neither ordered list, so eviction never skips anything.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy

T1, T2 = 1, 2
_MISSING = object()


class ArcArm(CachePolicy):
    """ARC over the resident keys of a tier, able to be loaded from and exported to another arm."""

    name = "arc_arm"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()  # unpinned, least recent first
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()  # ghosts, oldest first
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.where: dict[OffloadKey, int] = {}  # every resident key -> T1 or T2
        self.pinned: set[OffloadKey] = set()
        self.n1 = 0  # |T1|, pinned included
        self.n2 = 0

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, key: object) -> bool:
        return key in self.where

    def num_evictable(self) -> int:
        return len(self.t1) + len(self.t2)

    def _trim_ghosts(self) -> None:
        c = self.capacity
        b1, b2 = self.b1, self.b2
        over1 = self.n1 + len(b1) - c
        for _ in range(min(len(b1), over1)):  # nothing when over1 <= 0
            b1.popitem(last=False)
        over = self.n1 + self.n2 + len(b1) + len(b2) - 2 * c
        while over > 0 and b2:
            b2.popitem(last=False)
            over -= 1
        while over > 0 and b1:
            b1.popitem(last=False)
            over -= 1

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        b1, b2, t1, t2, where = self.b1, self.b2, self.t1, self.t2, self.where
        if (not b1 or b1.keys().isdisjoint(keys)) and (not b2 or b2.keys().isdisjoint(keys)):
            # No ghost hit (the usual store): all of them join T1, tail first, no pops.
            for key in keys[::-1]:
                t1[key] = None
            where.update(dict.fromkeys(keys, T1))
            self.n1 += len(keys)
            self._trim_ghosts()
            return
        missing = _MISSING
        again = 0
        for key in self.chain_order(keys):
            # A ghost hit comes back as a key used again (ARC's cases II and III).
            if b1.pop(key, missing) is not missing or b2.pop(key, missing) is not missing:
                t2[key] = None
                where[key] = T2
                again += 1
            else:
                t1[key] = None
                where[key] = T1
        self.n2 += again
        self.n1 += len(keys) - again
        self._trim_ghosts()

    def access(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, where, pinned = self.t1, self.t2, self.where, self.pinned
        for key in self.chain_order(keys):
            if where[key] == T1:
                where[key] = T2
                self.n1 -= 1
                self.n2 += 1
                if key not in pinned:
                    del t1[key]
                    t2[key] = None
            elif key not in pinned:
                t2.move_to_end(key)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, where, pinned = self.t1, self.t2, self.where, self.pinned
        for key in keys:
            del (t1 if where[key] == T1 else t2)[key]
            pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, where, pinned = self.t1, self.t2, self.where, self.pinned
        for key in self.chain_order(keys):
            pinned.remove(key)
            (t1 if where[key] == T1 else t2)[key] = None

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        b1, b2 = self.b1, self.b2
        p, cap = self.p, float(self.capacity)
        in_b2: list[bool] | None = None  # None: no incoming key in B2
        if (b1 and not b1.keys().isdisjoint(incoming)) or (
            b2 and not b2.keys().isdisjoint(incoming)
        ):
            in_b2 = []
            for key in incoming:
                if key in b1:
                    p = min(cap, p + max(len(b2) / len(b1), 1.0))
                    in_b2.append(False)
                elif key in b2:
                    p = max(0.0, p - max(len(b1) / len(b2), 1.0))
                    in_b2.append(True)
                else:
                    in_b2.append(False)
            self.p = p
        t1, t2, where = self.t1, self.t2, self.where
        n1, n2 = self.n1, self.n2
        off = len(incoming) - n
        victims: list[OffloadKey] = []
        pop1, pop2 = t1.popitem, t2.popitem
        i = 0
        while i < n:
            # ARC's REPLACE for incoming[off + i], a run of victims at a time: T1 while it
            # is over its target (the run stops where it would reach it), T2 while T1 is
            # under it (T1's size does not change meanwhile); on a tie the newcomer's
            # B2 flag decides one victim. An empty list defers to the other.
            if t1 and (not t2 or n1 > p):
                k = min(n - i, len(t1))
                if t2:
                    k = min(k, math.ceil(n1 - p))
                run = [pop1(last=False)[0] for _ in range(k)]
                n1 -= k
                ghost = b1
            elif t2 and (not t1 or n1 < p):
                k = min(n - i, len(t2))
                run = [pop2(last=False)[0] for _ in range(k)]
                n2 -= k
                ghost = b2
            else:
                j = off + i
                k = 1
                if j >= 0 and in_b2 is not None and in_b2[j]:
                    run = [pop1(last=False)[0]]
                    n1 -= 1
                    ghost = b1
                else:
                    run = [pop2(last=False)[0]]
                    n2 -= 1
                    ghost = b2
            for key in run:
                ghost[key] = None
                del where[key]
            victims += run
            i += k
        self.n1, self.n2 = n1, n2
        # No ghost trim: a victim moves from T1 to B1 or T2 to B2, which keeps both
        # bounds (|T1| + |B1| and the total) as they were.
        return victims

    def discard(self, key: OffloadKey) -> None:
        """Forget resident ``key`` (pinned or not) without remembering it as a ghost."""
        label = self.where.pop(key)
        if key in self.pinned:
            self.pinned.discard(key)
        else:
            del (self.t1 if label == T1 else self.t2)[key]
        if label == T1:
            self.n1 -= 1
        else:
            self.n2 -= 1

    def export(self) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """The unpinned keys of T1 and of T2, each least recent first (O(n): a switch only)."""
        return list(self.t1), list(self.t2)

    def load(
        self,
        once: Iterable[OffloadKey],
        again: Iterable[OffloadKey],
        pinned: Iterable[OffloadKey],
        p: float,
    ) -> None:
        """Become T1 = ``once``, T2 = ``again`` (each least recent first) with ``pinned``
        (not in either) resident in T2, and target ``p``; forget every ghost. O(n): a switch."""
        self.__init__(self.capacity)  # type: ignore[misc]
        self.t1 = OrderedDict.fromkeys(once)
        self.t2 = OrderedDict.fromkeys(again)
        where = self.where
        for key in self.t1:
            where[key] = T1
        for key in self.t2:
            where[key] = T2
        self.pinned = set(pinned)
        for key in self.pinned:
            where[key] = T2
        self.n1 = len(self.t1)
        self.n2 = len(self.t2) + len(self.pinned)
        self.p = max(0.0, min(float(self.capacity), p))
