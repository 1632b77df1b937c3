"""A keys-only ARC of a few slots: the ARC arm's shadow in the policy duel.

It replays the sampled reads the other shadows replay (``arms._Shadow``):
each key of a call is a read; a hit is a resident key, a miss stores it.
The rule is ARC's (T1 / T2 with ghost lists B1 / B2 adapting T1's target
``p``), applied per key, with one call's keys taken tail first as the real
``ArcArm`` takes them.

Invariants (c = capacity): |T1| + |T2| <= c, |T1| + |B1| <= c,
|T1| + |T2| + |B1| + |B2| <= 2c, 0 <= p <= c. O(1) per read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey

_MISSING = object()


class ShadowARC:
    """ARC over keys only (no pins, no slots): ``run`` counts the hits of a call's reads."""

    __slots__ = ("b1", "b2", "broken", "capacity", "p", "t1", "t2")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.broken = False  # this request's reads already missed (``run``'s ``lead``)

    def run(self, keys: Sequence[OffloadKey], lead: bool = False) -> int:
        """Read ``keys`` (updating state tail first, as the real arm); how many hit.

        With ``lead``, only hits before the request's first miss count (in chain
        order, head first), and a miss sets ``broken`` (the caller clears it when a
        request starts), as a lookup counts only a chain's leading stored blocks."""
        t1, t2 = self.t1, self.t2
        hits = 0
        if lead:
            broken = self.broken
            for key in keys:
                if broken:
                    break
                if key in t1 or key in t2:
                    hits += 1
                else:
                    broken = True
            self.broken = broken
        else:
            hits = sum(1 for key in keys if key in t1 or key in t2)
        self._read(keys)
        return hits

    def _read(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        c = self.capacity
        missing = _MISSING
        for key in reversed(keys):
            if t1.pop(key, missing) is not missing:
                t2[key] = None
                continue
            if key in t2:
                t2.move_to_end(key)
                continue
            if key in b1:
                self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
                del b1[key]
                self._replace(False)
                t2[key] = None
                continue
            if key in b2:
                self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
                del b2[key]
                self._replace(True)
                t2[key] = None
                continue
            # A new key (ARC's case IV): make room, trimming the ghosts as ARC does.
            n1 = len(t1)
            if n1 + len(b1) >= c:
                if n1 < c:
                    b1.popitem(last=False)
                    self._replace(False)
                else:
                    t1.popitem(last=False)
            elif n1 + len(t2) >= c:
                if n1 + len(t2) + len(b1) + len(b2) >= 2 * c and b2:
                    b2.popitem(last=False)
                self._replace(False)
            t1[key] = None

    def _replace(self, in_b2: bool) -> None:
        """Evict one resident key into its ghost list, if the cache is full."""
        t1, t2 = self.t1, self.t2
        if len(t1) + len(t2) < self.capacity:
            return
        n1 = len(t1)
        if t1 and (not t2 or n1 > self.p or (in_b2 and n1 == self.p)):
            self.b1[t1.popitem(last=False)[0]] = None
        else:
            self.b2[t2.popitem(last=False)[0]] = None
