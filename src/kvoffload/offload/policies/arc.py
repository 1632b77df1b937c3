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

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy

T1, T2 = 1, 2


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
        while self.b1 and self.n1 + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.n1 + self.n2 + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 or self.b1).popitem(last=False)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            if key in self.b1 or key in self.b2:
                self.b1.pop(key, None)
                self.b2.pop(key, None)
                self.t2[key] = None
                self._list_of[key] = T2
                self.n2 += 1
            else:
                self.t1[key] = None
                self._list_of[key] = T1
                self.n1 += 1
        self._trim_ghosts()

    def access(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            where = self._list_of[key]
            if key in self._pinned:
                if where == T1:
                    self._list_of[key] = T2
                    self.n1 -= 1
                    self.n2 += 1
                continue
            if where == T1:
                del self.t1[key]
                self._list_of[key] = T2
                self.n1 -= 1
                self.n2 += 1
                self.t2[key] = None
            else:
                self.t2.move_to_end(key)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            (self.t1 if self._list_of[key] == T1 else self.t2).pop(key)
            self._pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            self._pinned.remove(key)
            (self.t1 if self._list_of[key] == T1 else self.t2)[key] = None

    def _adapt(self, key: OffloadKey) -> bool:
        """Ghost hit on ``key``: move ``p``; returns whether it was a B2 hit."""
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            return True
        return False

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        in_b2 = [self._adapt(key) for key in incoming]
        victims: list[OffloadKey] = []
        for i in range(n):
            # Room for incoming[-n + i]: ARC's REPLACE with that key's B2 flag.
            x_in_b2 = in_b2[len(in_b2) - n + i] if len(in_b2) >= n - i else False
            take_t1 = bool(self.t1) and (
                not self.t2 or self.n1 > self.p or (x_in_b2 and self.n1 == self.p)
            )
            if take_t1:
                key, _ = self.t1.popitem(last=False)
                self.n1 -= 1
                self.b1[key] = None
            else:
                key, _ = self.t2.popitem(last=False)
                self.n2 -= 1
                self.b2[key] = None
            del self._list_of[key]
            victims.append(key)
        self._trim_ghosts()
        return victims
