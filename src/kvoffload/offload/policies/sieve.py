"""SIEVE (Zhang et al., NSDI 2024): a FIFO queue with a moving hand and one visited bit.

Keys are kept in insertion order. A hit only sets the key's visited bit. To
evict, the hand walks from where it stopped last toward newer keys (wrapping
to the oldest): a visited key has its bit cleared and stays in place, the
first unvisited one is evicted. Survivors are never moved, so popular keys
settle behind the hand while new one-hit keys are evicted quickly. Every bit
the hand clears was set by an access: O(1) amortised.

Pinned keys leave the queue (the hand never meets them) and come back as the
newest when unpinned.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy


class _Node:
    __slots__ = ("key", "newer", "older", "visited")

    def __init__(self, key: OffloadKey) -> None:
        self.key = key
        self.visited = False
        self.older: _Node | None = None
        self.newer: _Node | None = None


class SievePolicy(CachePolicy):
    name = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._nodes: dict[OffloadKey, _Node] = {}  # resident, pinned included
        self._pinned: set[OffloadKey] = set()
        self._oldest: _Node | None = None
        self._newest: _Node | None = None
        self._hand: _Node | None = None
        self._linked = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def num_evictable(self) -> int:
        return self._linked

    def _link_newest(self, node: _Node) -> None:
        node.newer = None
        node.older = self._newest
        if self._newest is None:
            self._oldest = node
        else:
            self._newest.newer = node
        self._newest = node
        self._linked += 1

    def _unlink(self, node: _Node) -> None:
        if self._hand is node:
            self._hand = node.newer
        if node.older is None:
            self._oldest = node.newer
        else:
            node.older.newer = node.newer
        if node.newer is None:
            self._newest = node.older
        else:
            node.newer.older = node.older
        node.older = node.newer = None
        self._linked -= 1

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            node = _Node(key)
            self._nodes[key] = node
            self._link_newest(node)

    def access(self, keys: Sequence[OffloadKey]) -> None:
        nodes = self._nodes
        for key in keys:
            nodes[key].visited = True

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self._unlink(self._nodes[key])
            self._pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            self._pinned.remove(key)
            self._link_newest(self._nodes[key])

    def _evict_one(self) -> OffloadKey:
        node = self._hand or self._oldest
        assert node is not None, "evict called with nothing evictable"
        while node.visited:
            node.visited = False
            node = node.newer or self._oldest  # type: ignore[assignment]
        self._hand = node.newer
        self._unlink(node)
        del self._nodes[node.key]
        return node.key

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        return [self._evict_one() for _ in range(n)]
