"""The connector asks the tier which blocks to store (``admit``) and offers only those."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.blocks import BlockPool
from kvoffload.engine.connector import SimpleCPUOffloadScheduler
from kvoffload.hashing import BlockHash, hash_request_tokens, xxhash64
from kvoffload.offload import CPUOffloadingManager, OffloadKey, PrepareStoreOutput

from .conftest import BS, Harness


class DecliningManager(CPUOffloadingManager):
    """LRU tier that declines the keys in ``no`` and records every store offer."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, cache_policy="lru")
        self.no: set[OffloadKey] = set()
        self.asked: list[list[OffloadKey]] = []
        self.offered: list[list[OffloadKey]] = []

    def admit(self, keys: Sequence[OffloadKey]) -> list[bool] | None:
        self.asked.append(list(keys))
        return [k not in self.no for k in keys]

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        self.offered.append(list(keys))
        return super().prepare_store(keys)


def _harness(store_mode: str) -> tuple[Harness, DecliningManager]:
    h = Harness(num_gpu=16, num_cpu=8, store_mode=store_mode)
    m = DecliningManager(8)
    h.manager = m
    h.conn = SimpleCPUOffloadScheduler(h.pool, m, BS, store_mode=store_mode)
    return h, m


def test_eager_stores_offer_only_admitted_blocks() -> None:
    h, m = _harness("eager")
    tokens = list(range(12))  # three full blocks
    hs = hash_request_tokens(tokens, BS, xxhash64)
    ks = h.conn.offload_keys(hs)
    m.no = {ks[1]}
    h.compute("r", tokens)
    assert m.asked == [ks]
    assert m.offered == [[ks[0], ks[2]]]
    meta = h.conn.build_connector_meta()
    assert len(meta.stores) == 1 and len(meta.stores[0].src) == 2
    assert h.conn.stats.stores_declined == 1
    assert not m.is_storing(ks[1]) and not m.is_stored(ks[1])


def test_eager_store_all_declined_offers_nothing() -> None:
    h, m = _harness("eager")
    tokens = list(range(8))
    ks = h.conn.offload_keys(hash_request_tokens(tokens, BS, xxhash64))
    m.no = set(ks)
    h.compute("r", tokens)
    assert m.offered == []
    assert h.conn.build_connector_meta().stores == []


def test_lazy_walk_skips_declined_blocks_until_a_gpu_hit() -> None:
    h, m = _harness("lazy")
    pool: BlockPool = h.pool
    blocks = pool.get_new_blocks(4)
    hs = [BlockHash(bytes([i + 1]) * 8) for i in range(4)]
    for b, bh in zip(blocks, hs):
        pool.cache_full_blocks([b], [bh], 0, 1, BS)
    pool.free_blocks(blocks)
    ks = h.conn.offload_keys(hs)
    m.no = {ks[0], ks[2]}
    assert h.conn.schedule_lazy_stores(window=16) == 2
    assert m.offered == [[ks[1], ks[3]]]
    h.finish_all()
    # The next walks do not offer the declined blocks again ...
    m.asked.clear()
    h.conn.schedule_lazy_stores(window=16)
    assert all(ks[0] not in a and ks[2] not in a for a in m.asked)
    # ... until a GPU hit reads one: freeing it again is a new sighting.
    h.conn.touch_gpu_hit(hs[:1], 1)
    assert not h.conn.was_declined(ks[0]) and h.conn.was_declined(ks[2])
