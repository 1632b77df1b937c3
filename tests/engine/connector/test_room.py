"""The connector sizes stores by the manager's one room formula, ``num_room_blocks``."""

from __future__ import annotations

from kvoffload.blocks import BlockPool
from kvoffload.engine.connector import SimpleCPUOffloadScheduler
from kvoffload.hashing import hash_request_tokens, xxhash64
from kvoffload.offload import CPUOffloadingManager

BS = 4


class TightManager(CPUOffloadingManager):
    """Room for fewer keys than free + evictable slots (a manager keeping headroom)."""

    def num_room_blocks(self) -> int:
        return 1


def test_eager_and_lazy_stores_take_the_managers_room() -> None:
    for mode in ("eager", "lazy"):
        pool = BlockPool(16)
        manager = TightManager(8, cache_policy="lru")
        conn = SimpleCPUOffloadScheduler(pool, manager, BS, store_mode=mode)
        assert conn.cpu_room() == 1
        tokens = list(range(3 * BS))
        hs = hash_request_tokens(tokens, BS, xxhash64)
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks, hs, 0, 3, BS, tokens)
        if mode == "eager":
            conn.on_blocks_computed("r", blocks, hs, len(tokens))
        else:
            pool.free_blocks(reversed(blocks))
            conn.schedule_lazy_stores(window=16)  # the whole free queue
        meta = conn.build_connector_meta()
        assert sum(len(j.src.block_ids) for j in meta.stores) == 1, mode  # type: ignore[attr-defined]
        assert conn.stats.stores_skipped_no_room == (2 if mode == "eager" else 0)
