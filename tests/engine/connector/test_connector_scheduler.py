import pytest

from kvoffload.events import BlockRemoved, BlockStored
from kvoffload.offload import make_offload_key

from .conftest import BS, Harness, Result


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_store_after_compute_holds_gpu_refs_until_done() -> None:
    h = Harness()
    blocks, hs = h.compute("a", tokens(3 * BS + 1))
    h.pool.free_request_blocks(blocks)  # the request finished at once
    meta = h.conn.build_connector_meta()
    (job,) = meta.stores
    assert list(job.src.block_ids) == [b.block_id for b in blocks[:3]]
    assert len(job.dst.block_ids) == 3
    # the 3 full blocks are held by the store, the partial one is free
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 0]
    assert h.manager.lookup([make_offload_key(x) for x in hs]) == 0  # not loadable yet
    h.conn.update_connector_output([Result(job.job_id)])
    assert h.manager.lookup([make_offload_key(x) for x in hs]) == 3
    h.assert_nothing_held()


def test_hit_then_load() -> None:
    h = Harness()
    prompt = tokens(4 * BS + 2)
    hs = h.offload("a", prompt)
    h.pool.get_new_blocks(h.pool.get_num_free_blocks())  # evict all of the GPU tier
    for b in h.pool.blocks[1:]:
        if b.ref_cnt:
            h.pool.free_blocks([b])
    assert h.pool.get_cached_block(hs[0]) is None
    n, new = h.start_load("b", hs, len(prompt), 5)
    assert n == 4 * BS
    assert h.conn.is_loading("b")
    (load,) = h.conn.build_connector_meta().loads
    assert list(load.dst.block_ids) == [b.block_id for b in new[:4]]
    slots = [h.manager.slot_of(make_offload_key(x)) for x in hs]
    assert list(load.src.block_ids) == slots
    assert h.manager.ref_count(make_offload_key(hs[0])) == 1  # pinned
    loaded, failed = h.conn.update_connector_output([Result(load.job_id)])
    assert loaded == {"b"} and failed == set()
    assert h.manager.ref_count(make_offload_key(hs[0])) == 0
    h.pool.free_request_blocks(new)
    h.assert_nothing_held()


def test_block_of_the_last_prompt_token_is_loaded_and_only_that_token_recomputed() -> None:
    """vLLM 0.33: the offloaded block holding the last prompt token is loaded too."""
    h = Harness()
    prompt = tokens(2 * BS)
    hs = h.offload("a", prompt)
    # the whole prompt is two full blocks: both load, the engine recomputes 1 token
    n = h.conn.get_num_new_matched_tokens("b", hs, 0, len(prompt))
    assert n == len(prompt) - 1
    new = h.pool.get_new_blocks(-(-n // BS))  # what the engine allocates for n tokens
    assert len(new) == 2
    h.conn.update_state_after_alloc("b", new, n)
    (load,) = h.conn.build_connector_meta().loads
    assert list(load.dst.block_ids) == [b.block_id for b in new]
    assert list(load.src.block_ids) == [h.manager.slot_of(make_offload_key(x)) for x in hs]
    h.conn.update_connector_output([Result(load.job_id)])
    # a GPU hit of one block: the tier supplies the last block, minus its last token
    assert h.conn.get_num_new_matched_tokens("c", hs, BS, len(prompt)) == BS - 1
    # an unaligned prompt: its full blocks all load, the partial tail is computed
    assert h.conn.get_num_new_matched_tokens("d", hs, 0, len(prompt) + 1) == 2 * BS


def test_last_token_rule_with_block_size_factor_and_size_one_blocks() -> None:
    from kvoffload.blocks import BlockPool
    from kvoffload.engine.connector import OffloadingConnectorScheduler
    from kvoffload.hashing import hash_request_tokens, xxhash64
    from kvoffload.offload import CPUOffloadingManager

    pool = BlockPool(32)
    m = CPUOffloadingManager(16, cache_policy="lru")
    conn = OffloadingConnectorScheduler(pool, m, BS, block_size_factor=2)
    prompt = tokens(4 * BS)
    hs = hash_request_tokens(prompt, BS, xxhash64)
    conn.store_blocks("a", [(conn._key(hs, j), pool.get_new_blocks(2)) for j in range(2)])
    conn.update_connector_output([Result(j.job_id) for j in conn.build_connector_meta().stores])
    n = conn.get_num_new_matched_tokens("b", hs, 0, len(prompt))
    assert n == 4 * BS - 1  # both offloaded blocks (8 tokens each), one token recomputed
    gpu = pool.get_new_blocks(-(-n // BS))
    conn.update_state_after_alloc("b", gpu, n)
    (load,) = conn.build_connector_meta().loads
    assert len(load.dst.block_ids) == 4

    one = OffloadingConnectorScheduler(BlockPool(8), CPUOffloadingManager(8, "lru"), 1)
    hs1 = hash_request_tokens(tokens(3), 1, xxhash64)
    one.store_blocks("a", [(one._key(hs1, j), one.pool.get_new_blocks(1)) for j in range(3)])
    one.update_connector_output([Result(j.job_id) for j in one.build_connector_meta().stores])
    # block size 1: the last block is the last token alone, computed, never loaded
    assert one.get_num_new_matched_tokens("b", hs1, 0, 3) == 2


def test_partial_hit_after_gpu_prefix() -> None:
    h = Harness()
    prompt = tokens(5 * BS)
    _blocks, hs = h.compute("a", prompt[: 3 * BS])
    h.finish_all()
    from kvoffload.hashing import hash_request_tokens, xxhash64

    full = hash_request_tokens(prompt, BS, xxhash64)
    assert full[:3] == hs
    # GPU hit of 1 block: the tier supplies blocks 1 and 2
    assert h.conn.get_num_new_matched_tokens("b", full, BS, len(prompt)) == 2 * BS
    # unaligned GPU hit: nothing
    assert h.conn.get_num_new_matched_tokens("b", full, BS + 1, len(prompt)) == 0


def test_failed_load_is_reported_and_releases_everything() -> None:
    h = Harness()
    prompt = tokens(3 * BS)
    hs = h.offload("a", prompt)
    _n, new = h.start_load("b", hs, len(prompt), 3)
    loaded, failed = h.finish_all(success=False)
    assert failed == {"b"} and loaded == set()
    h.pool.free_request_blocks(new)
    h.assert_nothing_held()
    assert h.manager.lookup([make_offload_key(x) for x in hs]) == 3  # still stored


def test_failed_store_leaves_keys_unknown() -> None:
    h = Harness()
    blocks, hs = h.compute("a", tokens(2 * BS))
    h.finish_all(success=False)
    h.pool.free_request_blocks(blocks)
    assert h.manager.lookup([make_offload_key(hs[0])]) == 0
    assert not h.manager.is_stored(make_offload_key(hs[0]))
    assert h.conn.stats.stores_failed == 1
    h.assert_nothing_held()


def test_abort_mid_load_keeps_blocks_until_copy_settles() -> None:
    h = Harness()
    prompt = tokens(3 * BS)
    hs = h.offload("a", prompt)
    _n, new = h.start_load("b", hs, len(prompt), 3)
    meta = h.conn.build_connector_meta()
    # the engine aborts b: frees its blocks, forgets it
    h.conn.request_finished("b")
    h.pool.free_request_blocks(new)
    assert [b.ref_cnt for b in new[:2]] == [1, 1]  # still held by the copy
    assert new[0] not in h.pool.free_block_queue
    loaded, failed = h.conn.update_connector_output([Result(j.job_id) for j in meta.loads])
    assert loaded == set() and failed == set()  # nobody to wake
    h.assert_nothing_held()


def test_preempted_mid_store_keeps_source_blocks() -> None:
    h = Harness()
    blocks, hs = h.compute("a", tokens(2 * BS))
    h.conn.request_preempted("a")
    h.pool.free_request_blocks(blocks)
    assert all(b.ref_cnt == 1 for b in blocks)
    h.finish_all()
    h.assert_nothing_held()
    assert h.manager.lookup([make_offload_key(x) for x in hs]) == 2


def test_duplicate_store_in_flight_is_skipped() -> None:
    h = Harness()
    h.compute("a", tokens(2 * BS))
    h.compute("b", tokens(2 * BS))
    meta = h.conn.build_connector_meta()
    assert len(meta.stores) == 1


def test_no_room_skips_store() -> None:
    h = Harness(num_cpu=2)
    h.compute("a", tokens(2 * BS))
    meta = h.conn.build_connector_meta()  # both slots being stored (not evictable)
    h.compute("b", tokens(2 * BS, base=100))
    assert h.conn.build_connector_meta().stores == []
    assert h.conn.stats.stores_skipped_no_room == 2
    h.conn.update_connector_output([Result(j.job_id) for j in meta.stores])


def test_unknown_job_result_is_an_error() -> None:
    h = Harness()
    with pytest.raises(ValueError, match="unknown job"):
        h.conn.update_connector_output([Result(999)])


def test_take_events_block_size_zero_and_medium() -> None:
    h = Harness(num_cpu=2)
    _, hs = h.compute("a", tokens(2 * BS))
    h.finish_all()
    events = h.conn.take_events()
    assert events == [
        BlockStored(
            block_hashes=list(hs),
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium="CPU",
        )
    ]
    _, hs2 = h.compute("b", tokens(1 * BS, base=50))
    h.finish_all()
    ev = h.conn.take_events()
    assert isinstance(ev[0], BlockRemoved) and ev[0].medium == "CPU"
    assert len(ev[0].block_hashes) == 1
    assert ev[1].block_hashes == hs2


def test_bad_arguments() -> None:
    h = Harness()
    from kvoffload.engine.connector import OffloadingConnectorScheduler

    with pytest.raises(ValueError, match="store_mode"):
        OffloadingConnectorScheduler(h.pool, h.manager, BS, store_mode="sometimes")
    with pytest.raises(ValueError, match="positive"):
        OffloadingConnectorScheduler(h.pool, h.manager, 0)


def test_store_larger_than_the_tier_keeps_the_chain_head() -> None:
    h = Harness(num_cpu=2)
    _, hs = h.compute("a", tokens(4 * BS))
    (job,) = h.conn.build_connector_meta().stores
    assert len(job.dst.block_ids) == 2
    h.conn.update_connector_output([Result(job.job_id)])
    assert h.manager.lookup([make_offload_key(x) for x in hs]) == 2  # the first two
    assert h.conn.stats.stores_skipped_no_room == 2


def test_reset_cache_refuses_while_jobs_run_then_empties_the_tier() -> None:
    h = Harness()
    blocks, hs = h.compute("a", tokens(2 * BS + 1))  # an eager store is queued
    assert h.conn.reset_cache() is False  # a job is in flight
    h.finish_all()
    h.conn.take_events()
    assert h.conn.reset_cache() is True
    assert h.manager.lookup([make_offload_key(x) for x in hs]) == 0
    (ev,) = h.conn.take_events()
    assert isinstance(ev, BlockRemoved) and ev.medium == "CPU"
    assert sorted(ev.block_hashes) == sorted(hs)
    # store progress starts over: the running request offers its blocks again
    h.conn.on_blocks_computed("a", blocks, hs, 2 * BS + 1)
    (job,) = h.conn.build_connector_meta().stores
    assert len(job.dst.block_ids) == 2
