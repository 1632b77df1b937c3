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

    def offload(self, req_id: str, tokens: list[int]) -> list[BlockHash]:
        """``compute`` a request, let its stores finish and free its GPU blocks: its full
        blocks are then in the CPU tier (and still cached on the GPU) only."""
        blocks, hs = self.compute(req_id, tokens)
        self.finish_all()
        self.pool.free_request_blocks(blocks)
        return hs

    def start_load(
        self, req_id: str, hs: list[BlockHash], num_tokens: int, num_blocks: int
    ) -> tuple[int, list[KVCacheBlock]]:
        """A request with no GPU hit asks the connector, gets ``num_blocks`` GPU blocks and
        the connector's loads are scheduled: (tokens the tier supplies, the GPU blocks)."""
        n = self.conn.get_num_new_matched_tokens(req_id, hs, 0, num_tokens)
        new = self.pool.get_new_blocks(num_blocks)
        self.conn.update_state_after_alloc(req_id, new, n)
        return n, new

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
