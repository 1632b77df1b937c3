"""Chain-aware LRU: a chain's continuation is kept behind (evicted before) its prefix.

Plain ``lru`` already makes each call's head the most recent key. What it
cannot see is across calls: a request loads its prefix from the tier, and
the blocks it computes after that are stored later, so they come out *more*
recent than the prefix they extend. When that conversation goes cold, LRU
then evicts the prefix first and keeps its continuation, which no lookup can
reach any more (a lookup stops at the first missing block).

Here the manager passes parent hints (``hint_parent(child, parent)``: the
first block missing after a lookup's hits, and the first new block after a
store's already stored ones), and ``insert`` places a hinted key right behind
its parent in the recency list; the rest of one call's keys go right behind
their predecessor, so a chain keeps its head newest. Keys without a hint (or
whose parent is pinned or gone) go to the most recent end, as in ``lru``.

An intrusive doubly linked list (sentinels at both ends) makes insert
behind a given key O(1). Hints are kept for at most ``capacity`` children.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy


class _Node:
    """One list entry. No ``__init__``: ``insert`` (the hot path) sets every field as it
    links the node (a Python-level ``__init__`` call would double the cost of a node)."""

    __slots__ = ("key", "newer", "older")
    key: OffloadKey | None
    older: _Node | None
    newer: _Node | None


def _sentinel() -> _Node:
    node = _Node()
    node.key = node.older = node.newer = None
    return node


class ChainLRUPolicy(CachePolicy):
    name = "chain_lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._lru = _sentinel()  # before the least recent
        self._mru = _sentinel()  # after the most recent
        self._lru.newer = self._mru
        self._mru.older = self._lru
        self._nodes: dict[OffloadKey, _Node] = {}  # resident, pinned included
        self._linked = 0
        self._hints: OrderedDict[OffloadKey, OffloadKey] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def num_evictable(self) -> int:
        return self._linked

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        hints = self._hints
        hints[child] = parent
        hints.move_to_end(child)
        if len(hints) > self.capacity:
            hints.popitem(last=False)

    def _link_behind(self, node: _Node, anchor: _Node) -> None:
        """Link ``node`` just less recent than ``anchor``."""
        older = anchor.older
        assert older is not None
        node.older = older
        node.newer = anchor
        older.newer = node
        anchor.older = node
        self._linked += 1

    def _unlink(self, node: _Node) -> None:
        older, newer = node.older, node.newer
        assert older is not None and newer is not None
        older.newer = newer
        newer.older = older
        node.older = node.newer = None
        self._linked -= 1

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        nodes, hints = self._nodes, self._hints
        anchor = self._mru
        for key in keys:
            if hints:
                parent = hints.pop(key, None)
                if parent is not None:
                    pnode = nodes.get(parent)
                    if pnode is not None and pnode.older is not None:
                        anchor = pnode
            node = _Node()
            node.key = key
            nodes[key] = node
            # Linked just less recent than the anchor (inline _link_behind: the hot path).
            older = anchor.older
            node.older = older
            node.newer = anchor
            older.newer = node  # type: ignore[union-attr]
            anchor.older = node
            anchor = node
        self._linked += len(keys)

    def access(self, keys: Sequence[OffloadKey]) -> None:
        nodes, mru = self._nodes, self._mru
        for key in keys[::-1]:  # chain_order, inlined with the moves: the hot path
            node = nodes[key]
            older = node.older
            if older is not None:
                newer = node.newer
                if newer is not mru:
                    # Unlinked, then linked just less recent than the MRU sentinel
                    # (the linked count does not change).
                    older.newer = newer
                    newer.older = older  # type: ignore[union-attr]
                    last = mru.older
                    node.older = last
                    node.newer = mru
                    last.newer = node  # type: ignore[union-attr]
                    mru.older = node

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        nodes = self._nodes
        for key in keys:  # _unlink, inlined: every load pins its keys
            node = nodes[key]
            older, newer = node.older, node.newer
            older.newer = newer  # type: ignore[union-attr]
            newer.older = older  # type: ignore[union-attr]
            node.older = node.newer = None
        self._linked -= len(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        nodes, mru = self._nodes, self._mru
        for key in keys[::-1]:  # chain order, with _link_behind(node, mru) inlined
            node = nodes[key]
            last = mru.older
            node.older = last
            node.newer = mru
            last.newer = node  # type: ignore[union-attr]
            mru.older = node
        self._linked += len(keys)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        # The n least recent nodes are cut out as one run of the list. When the run takes
        # the block this store continues (the hinted parent of its first key: a store that
        # needs nearly the whole tier eats into its own chain, whose read blocks are the
        # newest, tail first), the new keys are anchored behind the first block left, the
        # chain's last stored one after a lookup: else they would go to the recent end,
        # and the chain's stored head would be the next to go, ahead of its new tail.
        victims: list[OffloadKey] = []
        nodes = self._nodes
        head = self._lru
        parent = self._continued(incoming) if n else None
        node = head.newer
        for _ in range(n):
            assert node is not None and node.key is not None, "nothing evictable"
            victims.append(node.key)
            del nodes[node.key]
            nxt = node.newer
            node.older = node.newer = None
            node = nxt
        if n:
            assert node is not None  # the tail sentinel at least
            head.newer = node
            node.older = head
            self._linked -= n
            if parent is not None and parent.older is None and node.key is not None:
                self._hints[incoming[0]] = node.key
        return victims

    def _continued(self, incoming: Sequence[OffloadKey]) -> _Node | None:
        """The linked node of the block ``incoming`` continues (its first key's hinted parent)."""
        if not incoming or not self._hints:
            return None
        parent = self._hints.get(incoming[0])
        if parent is None:
            return None
        node = self._nodes.get(parent)
        return node if node is not None and node.older is not None else None

    def discard(self, key: OffloadKey) -> None:
        """Forget resident ``key`` (pinned or not) without counting it as evicted."""
        node = self._nodes.pop(key)
        if node.older is not None:
            self._unlink(node)

    def is_pinned(self, key: OffloadKey) -> bool:
        """Whether resident ``key`` is pinned (a pinned node is unlinked)."""
        return self._nodes[key].older is None

    def pinned_keys(self) -> list[OffloadKey]:
        """Resident keys that are pinned (O(n): for switching policies, not the hot path)."""
        return [k for k, node in self._nodes.items() if node.older is None]

    def lru_order(self) -> list[OffloadKey]:
        """Unpinned keys, next victim first (for tests and debugging; O(n))."""
        out: list[OffloadKey] = []
        node = self._lru.newer
        while node is not None and node.key is not None:
            out.append(node.key)
            node = node.newer
        return out
