"""The simple CPU offloader: one CPU tier, eager or lazy stores."""

from __future__ import annotations

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.connector.lazy import LazyStoreWalker
from kvoffload.engine.connector.scheduler import OffloadingConnectorScheduler
from kvoffload.offload.base import OffloadingManager, make_offload_key

LAZY_REQ_ID = "<lazy-offload>"


class SimpleCPUOffloadScheduler(OffloadingConnectorScheduler):
    """Offloading connector with the two store modes of the CPU offloader.

    eager: each block is stored once its KV is computed (``on_blocks_computed``).
    lazy: ``schedule_lazy_stores(window)`` runs once per step and stores only
    the cached GPU blocks that are about to be evicted (see ``LazyStoreWalker``).
    Lazy saves copy bandwidth on blocks that die in the GPU tier anyway (never
    freed while cached, or overwritten before reaching the queue's front).
    """

    def __init__(
        self,
        block_pool: BlockPool,
        manager: OffloadingManager,
        block_size: int,
        store_mode: str = "eager",
        group_idx: int = 0,
    ) -> None:
        if store_mode not in ("eager", "lazy"):
            raise ValueError(f"store_mode must be 'eager' or 'lazy', got {store_mode!r}")
        super().__init__(block_pool, manager, block_size, 1, group_idx, store_mode)
        self.walker = LazyStoreWalker(block_pool)

    def _wants_copy(self, block: KVCacheBlock) -> bool:
        h = block.block_hash
        if h is None:
            return False
        key = make_offload_key(h, self.group_idx)
        return (
            key not in self._in_flight_keys
            and not self.manager.is_stored(key)
            and not self.was_declined(key)
        )

    def reset_cache(self) -> bool:
        """As the base class; the lazy walk also starts over (the tier lost its copies)."""
        if not super().reset_cache():
            return False
        self.walker = LazyStoreWalker(self.pool)
        return True

    def cpu_room(self) -> int:
        return self.manager.num_room_blocks()

    def schedule_lazy_stores(self, window: int) -> int:
        """Make the first ``window`` GPU free blocks safe to evict; returns blocks queued."""
        if self.store_mode != "lazy":
            return 0
        chosen = self.walker.walk(window, self.cpu_room(), self._wants_copy)
        if not chosen:
            return 0
        cands = [(make_offload_key(b.block_hash, self.group_idx), [b]) for b in chosen]  # type: ignore[arg-type]
        return self.store_blocks(LAZY_REQ_ID, cands)
