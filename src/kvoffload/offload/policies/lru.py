"""Least recently used, in two flavours: chain-aware (``lru``) and per call order (``lru_flat``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy


class LRUPolicy(CachePolicy):
    """Evicts the least recently used unpinned key.

    Recency is the last insert, access or unpin. Within one call the chain's
    head counts as the most recent (see ``CachePolicy.chain_order``), so of a
    chain that is not read again the tail goes first and the head last.
    A pinned key leaves the order and comes back as most recent when unpinned
    (its load is its latest use).
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()  # unpinned, LRU first
        self._pinned: set[OffloadKey] = set()

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    def num_evictable(self) -> int:
        return len(self._order)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        for key in self.chain_order(keys):
            order[key] = None

    def access(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        for key in self.chain_order(keys):
            if key in order:
                order.move_to_end(key)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            del self._order[key]
            self._pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        for key in self.chain_order(keys):
            self._pinned.remove(key)
            order[key] = None

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        popitem = self._order.popitem
        return [popitem(last=False)[0] for _ in range(n)]

    def discard(self, key: OffloadKey) -> None:
        """Forget resident ``key`` (pinned or not) without counting it as evicted."""
        if self._order.pop(key, self) is self:
            self._pinned.remove(key)

    def lru_order(self) -> list[OffloadKey]:
        """Unpinned keys, next victim first (for tests and debugging; O(n))."""
        return list(self._order)


class FlatLRUPolicy(LRUPolicy):
    """Textbook LRU over keys in the order given: a call's head ends up older than its tail.

    Kept as the chain-unaware baseline that shows what ``lru``'s ordering buys.
    """

    name = "lru_flat"

    @staticmethod
    def chain_order(keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        return keys
