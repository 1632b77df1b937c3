"""Chunks of several GPU blocks: a router counts only what the engine can load.

kvoffload's reference connector (``OffloadingConnectorScheduler``) with
``block_size_factor=2`` offloads chunks of two 4-token GPU blocks; its KV
events (the GPU tier's, and the CPU tier's self-describing, one event per
chunk) go to Dynamo's indexer, registered at the GPU block size. Dynamo counts
per GPU block, so for two prompts it credits blocks the engine cannot load:

- a prompt that ends inside a chunk (its leading block is advertised in the
  CPU tier, but the chunk is found only by its last block's hash);
- a prompt over a chunk half of whose GPU blocks are evicted (the GPU hit
  ends inside the chunk, and the reference engine loads a tier's chunks only
  from a chunk boundary).

``chunks.loadable_overlap`` (the rule of docs/routing.md) applied to Dynamo's
answer must equal what the engine loads: its GPU hit plus the connector's
answer to ``get_num_new_matched_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from kvoffload.bench.routing.chunks import loadable_overlap
from kvoffload.bench.routing.indexer import DynamoIndexer, TierOverlap
from kvoffload.blocks import BlockPool
from kvoffload.engine.connector import OffloadingConnectorScheduler
from kvoffload.events import BlockStored
from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.hashing import hash_request_tokens, sha256
from kvoffload.offload import CPUOffloadingManager
from tests.conftest_redis import free_port
from tests.router.test_dynamo_engine import wait_indexed

BS, F = 4, 2
CHUNK = BS * F
MODEL = "chunks"
PROMPT = [100 + i for i in range(8 * BS)]  # 4 chunks of 2 blocks


@dataclass
class _Done:
    job_id: int
    success: bool = True
    error: str | None = None


class Instance:
    """A GPU block pool, a CPU tier and the connector, publishing their events."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.pool = BlockPool(32, enable_kv_cache_events=True)
        self.cpu = CPUOffloadingManager(16, cache_policy="lru", enable_events=True)
        self.conn = OffloadingConnectorScheduler(self.pool, self.cpu, BS, block_size_factor=F)
        self.conn.events.self_describing = True
        self.pub = ZmqEventPublisher(endpoint, replay)
        self.published: list[object] = []

    def publish(self) -> None:
        events = self.pool.take_events() + self.conn.take_events()
        self.published.extend(events)
        self.pub.publish(events)

    def serve_and_offload(self, tokens: list[int]) -> list:
        """Compute ``tokens``' blocks, store every chunk to the CPU tier, free the blocks."""
        hs = hash_request_tokens(tokens, BS, sha256)
        blocks = self.pool.get_new_blocks(len(hs))
        self.pool.cache_full_blocks(blocks, hs, 0, len(hs), BS, tokens)
        chunks = [(self.conn._key(hs, j), blocks[j * F : (j + 1) * F]) for j in range(len(hs) // F)]
        self.conn.store_blocks("a", chunks)
        meta = self.conn.build_connector_meta()
        self.conn.update_connector_output([_Done(j.job_id) for j in meta.stores])
        self.pool.free_request_blocks(blocks)  # tail first: the chain's tail is evicted first
        self.publish()
        return hs

    def evict_gpu_blocks(self, n: int) -> None:
        """Evict the ``n`` cached GPU blocks first in line (the chain's tail first)."""
        never_cached = self.pool.get_num_free_blocks() - sum(
            1 for b in self.pool.blocks[1:] if b.block_hash is not None
        )
        taken = self.pool.get_new_blocks(never_cached + n)
        self.pool.free_blocks(taken)  # no hash: back to the front, nothing announced
        self.publish()

    def loadable(self, tokens: list[int]) -> int:
        """Tokens the engine serves without computing: its GPU hit, then the tier's load."""
        hs = hash_request_tokens(tokens, BS, sha256)
        gpu = 0
        for h in hs[: (len(tokens) - 1) // BS]:
            if self.pool.get_cached_block(h) is None:
                break
            gpu += 1
        tier = self.conn.get_num_new_matched_tokens("q", hs, gpu * BS, len(tokens)) or 0
        return gpu * BS + tier

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def instance(indexer: DynamoIndexer):
    port, replay = free_port(), free_port()
    inst = Instance(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    indexer.client.register(1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", MODEL, BS)
    time.sleep(0.5)  # the indexer's subscription connects (missed batches come by replay)
    try:
        yield inst
    finally:
        inst.close()


def _answer(indexer: DynamoIndexer, tokens: list[int]) -> TierOverlap:
    """Dynamo's answer once it has applied something and stopped changing."""
    client = indexer.client
    for _ in range(120):
        wait_indexed(client)
        dump = client.dump()
        if any(v.get("events") for v in dump.values() if isinstance(v, dict)):
            break
        time.sleep(0.25)
    return client.query(tokens, MODEL).get(1, TierOverlap())


def test_a_prompt_ending_inside_a_chunk_counts_whole_chunks_only(
    indexer: DynamoIndexer, instance: Instance
) -> None:
    instance.serve_and_offload(PROMPT)
    instance.evict_gpu_blocks(8)  # every GPU block gone: the CPU tier holds all 4 chunks
    cpu_stores = [e for e in instance.published if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [len(e.block_hashes) for e in cpu_stores] == [F] * 4  # one event per chunk
    for blocks, extra in ((5, 2), (3, 0), (1, 3), (7, 1)):
        prompt = PROMPT[: blocks * BS + extra]
        raw = _answer(indexer, prompt)
        want = instance.loadable(prompt)
        assert raw.gpu == 0 and raw.cpu == blocks * BS  # Dynamo counts every full block
        got = loadable_overlap(raw, CHUNK)
        assert got.disk == got.cpu == want == blocks // F * CHUNK, (blocks, extra)


def test_a_chunk_half_evicted_from_the_gpu_ends_the_hit_inside_it(
    indexer: DynamoIndexer, instance: Instance
) -> None:
    instance.serve_and_offload(PROMPT)
    instance.evict_gpu_blocks(3)  # blocks 8, 7, 6 go: chunk 3 keeps its first block (5)
    prompt = [*PROMPT, 7, 7, 7]
    raw = _answer(indexer, prompt)
    want = instance.loadable(prompt)
    assert (raw.gpu, raw.cpu) == (5 * BS, 8 * BS)  # Dynamo: the CPU tier goes on from block 6
    assert want == 5 * BS  # the engine: its GPU hit ends inside chunk 3, so no load
    got = loadable_overlap(raw, CHUNK)
    assert (got.gpu, got.cpu, got.disk) == (want, want, want)
    # Two whole chunks left on the GPU (blocks 5-8 evicted): the CPU tier goes on from there.
    instance.evict_gpu_blocks(1)
    raw = _answer(indexer, prompt)
    assert loadable_overlap(raw, CHUNK).cpu == instance.loadable(prompt) == 8 * BS


def test_the_rule_keeps_each_stage_within_the_one_before_and_never_grows_it() -> None:
    for gpu in range(0, 33, 4):
        for cpu in range(gpu, 41, 4):
            for disk in range(cpu, 49, 4):
                raw = TierOverlap(disk, gpu, cpu, disk)
                for tail in (False, True):
                    got = loadable_overlap(raw, CHUNK, tail_loads=tail)
                    assert got.gpu == gpu <= got.cpu <= got.disk == got.longest_matched
                    assert got.cpu <= cpu and got.disk <= disk
                    if got.cpu > gpu:
                        assert got.cpu % CHUNK == 0
                    if not tail and gpu % CHUNK:
                        assert got.disk == gpu
    # vLLM loads the rest of a chunk a GPU hit ends inside: the CPU stage counts on.
    assert loadable_overlap(TierOverlap(32, 20, 32, 32), CHUNK, tail_loads=True).cpu == 32
    with pytest.raises(ValueError):
        loadable_overlap(TierOverlap(), 0)
