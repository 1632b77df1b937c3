"""Lazy store selection: copy out GPU blocks only when they are about to be evicted.

The GPU free queue is in eviction order, so "about to be evicted" is "near
its front". Each step the walker makes sure the first ``window`` blocks of
the queue are safe to lose (not cached, or already in the CPU tier), choosing
the cached ones that are not for copying. It walks only through
``FreeKVCacheBlockQueue.iter_blocks_after`` and resumes from a saved cursor,
so each free block is looked at about once, however long it stays free.

Cursor rules (the walk must neither skip part of the queue nor rescan it):
- ``handled`` counts the queue's blocks from the front up to the cursor. The
  pool's ``num_allocated_total`` says how many blocks left the front since the
  last walk, and ``handled`` shrinks by that; ``num_prepended_total`` says how
  many freed empty blocks were put at the front (nothing to copy: handled),
  and ``handled`` grows by that.
- A chosen block leaves the queue (it is protected during its copy), so the
  cursor is always the last walked block that *stayed*: everything walked
  after it was taken out.
- The cursor is valid while it is in the queue with the ``alloc_epoch`` seen
  when it was saved. Reallocated (popped from the front): everything before it
  was popped too, so the walk restarts at the front, which is new ground.
  Taken by a hit, or taken and freed again at the tail: fall back to the
  previous cursor if that one is still valid, else to the front.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.blocks import BlockPool, KVCacheBlock


class LazyStoreWalker:
    __slots__ = (
        "_allocated_seen",
        "_cursor",
        "_epoch",
        "_prepended_seen",
        "_prev",
        "_prev_epoch",
        "handled",
        "pool",
    )

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._cursor: KVCacheBlock | None = None
        self._epoch = 0
        self._prev: KVCacheBlock | None = None
        self._prev_epoch = 0
        self.handled = 0
        self._allocated_seen = pool.num_allocated_total
        self._prepended_seen = pool.num_prepended_total

    @property
    def cursor(self) -> KVCacheBlock | None:
        return self._cursor

    def _valid(self, block: KVCacheBlock | None, epoch: int) -> bool:
        return (
            block is not None and block in self.pool.free_block_queue and block.alloc_epoch == epoch
        )

    def _settle_cursor(self) -> None:
        pool = self.pool
        popped = pool.num_allocated_total - self._allocated_seen
        pushed = pool.num_prepended_total - self._prepended_seen
        self._allocated_seen = pool.num_allocated_total
        self._prepended_seen = pool.num_prepended_total
        # Pops and pushes at the front interleave; while the cursor survives,
        # each popped block was before it, so the net change is exact.
        self.handled = max(0, self.handled + pushed - popped)
        if self._cursor is None:
            self.handled = 0
            return
        if self._valid(self._cursor, self._epoch):
            return
        if self._valid(self._prev, self._prev_epoch):
            self._cursor, self._epoch = self._prev, self._prev_epoch
            self._prev = None
            self.handled = max(0, self.handled - 1)
        else:
            self._cursor = self._prev = None
            self.handled = 0

    def walk(
        self,
        window: int,
        max_chosen: int,
        wants_copy: Callable[[KVCacheBlock], bool],
    ) -> list[KVCacheBlock]:
        """Blocks to copy so that the first ``window`` free blocks are safe.

        ``wants_copy(block)`` says whether a walked block needs a copy (cached
        and not yet in the tier). At most ``max_chosen`` are chosen. The chosen
        blocks are returned still in the queue; the caller takes them out
        (``BlockPool.touch``) before the next walk.
        """
        self._settle_cursor()
        if self.handled >= window or max_chosen <= 0:
            return []
        chosen: list[KVCacheBlock] = []
        queue = self.pool.free_block_queue
        for block in queue.iter_blocks_after(self._cursor):
            if wants_copy(block):
                if len(chosen) >= max_chosen:
                    break
                chosen.append(block)
                continue
            self._prev, self._prev_epoch = self._cursor, self._epoch
            self._cursor, self._epoch = block, block.alloc_epoch
            self.handled += 1
            if self.handled >= window:
                break
        return chosen
