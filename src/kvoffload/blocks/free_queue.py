"""The GPU tier's free blocks, in eviction order, as an intrusive linked list.

Why intrusive: a prefix hit takes a free-but-cached block out of the *middle*
of the queue, every engine step, for every hit block. The links live in the
blocks themselves, so remove is O(1) and no node object is allocated per
operation (a ``deque`` would need an O(n) remove, a node list an allocation).

Invariants:
- Order is eviction order: the front is evicted first. Freed cached blocks
  enter at the tail (``append_n``), so the least recently freed is evicted
  first; freed blocks with nothing cached enter at the front (``prepend_n``),
  so they are reused before any cached block is evicted.
- A block is in the queue iff its ``prev_free_block`` is not None (with two
  sentinels every member has both neighbours); removed blocks get both links
  cleared, which is what makes membership an O(1) check.
- Nothing outside this file touches the sentinels or the links: consumers walk
  the queue with ``iter_blocks_after``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvoffload.blocks.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None and block is not self._tail

    def popleft(self) -> KVCacheBlock:
        """Take the block to evict first."""
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise ValueError("popleft() on an empty free block queue")
        nxt = first.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head  # type: ignore[union-attr]
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` blocks to evict first, in eviction order."""
        if n < 0:
            raise ValueError(f"popleft_n(n) needs n >= 0, got {n}")
        if n > self.num_free_blocks:
            raise ValueError(f"popleft_n({n}) but only {self.num_free_blocks} free blocks")
        out: list[KVCacheBlock] = [None] * n  # type: ignore[list-item]
        cur = self._head.next_free_block
        for i in range(n):
            out[i] = cur  # type: ignore[assignment]
            nxt = cur.next_free_block  # type: ignore[union-attr]
            cur.prev_free_block = cur.next_free_block = None  # type: ignore[union-attr]
            cur = nxt
        self._head.next_free_block = cur
        cur.prev_free_block = self._head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle in O(1) (a prefix hit on a free block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"remove(): {block!r} is not in the free block queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it is evicted last."""
        if block.prev_free_block is not None or block is self._head or block is self._tail:
            raise ValueError(f"append(): {block!r} is already in the free block queue")
        last = self._tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` in order (the first given is evicted first)."""
        last = self._tail.prev_free_block
        n = 0
        try:
            for block in blocks:
                if block.prev_free_block is not None or block is self._head or block is self._tail:
                    raise ValueError(f"append_n(): {block!r} is already in the free block queue")
                last.next_free_block = block  # type: ignore[union-attr]
                block.prev_free_block = last
                last = block
                n += 1
        finally:
            # Close the list even on error, so the blocks linked so far stay consistent.
            last.next_free_block = self._tail  # type: ignore[union-attr]
            self._tail.prev_free_block = last
            self.num_free_blocks += n

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in order (the first given is evicted first).

        Checks first, so a bad call changes nothing.
        """
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            if (
                block.prev_free_block is not None
                or block is self._head
                or block is self._tail
                or id(block) in seen
            ):
                raise ValueError(f"prepend_n(): {block!r} is already in the free block queue")
            seen.add(id(block))
        if not blocks:
            return
        prev = self._head
        first = prev.next_free_block
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in eviction order (O(n): for tests and debugging)."""
        out: list[KVCacheBlock] = []
        cur = self._head.next_free_block
        while cur is not self._tail:
            out.append(cur)  # type: ignore[arg-type]
            cur = cur.next_free_block  # type: ignore[union-attr]
        return out

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after ``cursor`` (from the front if None).

        Raises ``ValueError`` at once (not on first ``next``) when ``cursor`` is
        not in the queue: a cursor whose block was allocated since must never
        turn into a silent empty or wrong walk.

        The walk reads each link just before yielding, so the consumer may
        remove the block it was just given (e.g. to copy it out), but must not
        otherwise change the queue while iterating.
        """
        if cursor is None:
            start = self._head.next_free_block
        else:
            if cursor.prev_free_block is None or cursor is self._head or cursor is self._tail:
                raise ValueError(f"iter_blocks_after(): cursor {cursor!r} is not in the queue")
            start = cursor.next_free_block
        return self._walk(start)

    def _walk(self, cur: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        tail = self._tail
        while cur is not tail and cur is not None:
            nxt = cur.next_free_block
            yield cur
            cur = nxt
