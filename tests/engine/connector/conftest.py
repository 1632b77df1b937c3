from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.connector import SimpleCPUOffloadScheduler
from kvoffload.hashing import BlockHash, hash_request_tokens, xxhash64
from kvoffload.offload import CPUOffloadingManager

BS = 4


@dataclass
class Result:
    job_id: int
    success: bool = True
    error: str | None = None


class Harness:
    """A block pool, a CPU manager and a connector, driven by hand."""

    def __init__(self, num_gpu: int = 16, num_cpu: int = 8, store_mode: str = "eager") -> None:
        self.pool = BlockPool(num_gpu)
        self.manager = CPUOffloadingManager(num_cpu, cache_policy="lru", enable_events=True)
        self.conn = SimpleCPUOffloadScheduler(self.pool, self.manager, BS, store_mode=store_mode)

    def compute(self, req_id: str, tokens: list[int]) -> tuple[list[KVCacheBlock], list[BlockHash]]:
        """Allocate, "compute" and cache a request's full blocks (no hit)."""
        hs = hash_request_tokens(tokens, BS, xxhash64)
        blocks = self.pool.get_new_blocks(-(-len(tokens) // BS))
        self.pool.cache_full_blocks(blocks, hs, 0, len(hs), BS, tokens)
        self.conn.on_blocks_computed(req_id, blocks, hs, len(tokens))
        return blocks, hs

    def finish_all(self, success: bool = True) -> tuple[set[str], set[str]]:
        meta = self.conn.build_connector_meta()
        results = [Result(j.job_id, success) for j in meta.loads + meta.stores]
        return self.conn.update_connector_output(results)

    def assert_nothing_held(self) -> None:
        assert self.conn.num_in_flight_jobs() == 0
        assert all(b.ref_cnt == 0 for b in self.pool.blocks[1:])
        assert self.manager.num_evictable_blocks() == self.manager.num_stored_blocks()


@pytest.fixture
def harness() -> Harness:
    return Harness()
