"""Requests through the connector with a real worker: CPU hits come back bit-identical."""

import torch

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.connector import SimpleCPUOffloadScheduler
from kvoffload.hashing import hash_request_tokens, xxhash64
from kvoffload.offload import CPUOffloadingManager
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVGeometry, KVLayout
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.worker import OffloadingWorker

BS = 4


def block_kv(tensors: list[torch.Tensor], layout: KVLayout, block_id: int) -> list[torch.Tensor]:
    out = []
    for layer in range(layout.geometry.num_layers):
        k, v = layout.layer_kv(tensors, layer)
        out += [k[block_id].clone(), v[block_id].clone()]
    return out


def fill_random(tensors, layout, block_id: int, gen: torch.Generator) -> None:
    for layer in range(layout.geometry.num_layers):
        k, v = layout.layer_kv(tensors, layer)
        k[block_id].copy_(torch.randn(k[block_id].shape, generator=gen))
        v[block_id].copy_(torch.randn(v[block_id].shape, generator=gen))


def run_jobs(conn, worker) -> tuple[set[str], set[str]]:
    meta = conn.build_connector_meta()
    ids = []
    for job in meta.loads + meta.stores:
        spec = TransferSpec(job.src, job.dst)
        (worker.submit_store if job.is_store else worker.submit_load)(job.job_id, spec)
        ids.append(job.job_id)
    worker.wait(ids)
    results = worker.get_finished()
    assert all(r.success for r in results), [r.error for r in results]
    return conn.update_connector_output(results)


def test_gpu_misses_served_from_cpu_bit_identical_no_leaks() -> None:
    for kind in ("layer_first", "kv_split", "cross_layer"):
        geo = KVGeometry(
            num_layers=2, num_kv_heads=2, head_size=8, block_size=BS, dtype=torch.float32
        )
        layout = KVLayout(geo, kind)
        gpu = layout.allocate(12)
        pool = BlockPool(12)
        manager = CPUOffloadingManager(32)
        conn = SimpleCPUOffloadScheduler(pool, manager, BS, store_mode="eager")
        worker = OffloadingWorker.for_cpu_tier(gpu, layout, HostPool(layout, 32))
        gen = torch.Generator().manual_seed(0)
        prompts = [[c * 100 + i for i in range(4 * BS + 1)] for c in range(4)]
        expected: dict[bytes, list[torch.Tensor]] = {}
        try:
            # First pass: "compute" each request's KV, store it, free its blocks.
            for r, prompt in enumerate(prompts):
                hs = hash_request_tokens(prompt, BS, xxhash64)
                blocks: list[KVCacheBlock] = pool.get_new_blocks(len(hs) + 1)
                for b in blocks:
                    fill_random(gpu, layout, b.block_id, gen)
                for b, h in zip(blocks, hs):
                    expected[h] = block_kv(gpu, layout, b.block_id)
                pool.cache_full_blocks(blocks, hs, 0, len(hs), BS, prompt)
                conn.on_blocks_computed(f"r{r}", blocks, hs, len(prompt))
                run_jobs(conn, worker)
                pool.free_request_blocks(blocks)
                conn.request_finished(f"r{r}")
            # The GPU tier (11 blocks) has since lost the first requests' blocks.
            first = hash_request_tokens(prompts[0], BS, xxhash64)
            assert pool.get_cached_block(first[0]) is None
            # Second pass: every request is served from the CPU tier.
            for r, prompt in enumerate(prompts):
                hs = hash_request_tokens(prompt, BS, xxhash64)
                n = conn.get_num_new_matched_tokens(f"s{r}", hs, 0, len(prompt))
                assert n == len(hs) * BS
                blocks = pool.get_new_blocks(len(hs) + 1)
                for b in blocks:  # garbage where the load must write
                    fill_random(gpu, layout, b.block_id, gen)
                conn.update_state_after_alloc(f"s{r}", blocks, n)
                loaded, failed = run_jobs(conn, worker)
                assert loaded == {f"s{r}"} and not failed
                for b, h in zip(blocks, hs):
                    got = block_kv(gpu, layout, b.block_id)
                    assert all(torch.equal(x, y) for x, y in zip(got, expected[h])), kind
                pool.free_request_blocks(blocks)
                conn.request_finished(f"s{r}")
            assert conn.num_in_flight_jobs() == 0
            assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
            assert manager.num_evictable_blocks() == manager.num_stored_blocks()
        finally:
            worker.close()
