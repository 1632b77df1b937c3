import pytest

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvoffload.hashing import BlockHash, hash_request_tokens, sha256_cbor

BS = 4


def hashes(tokens: list[int]) -> list[BlockHash]:
    return hash_request_tokens(tokens, BS, sha256_cbor)


def alloc_and_cache(pool: BlockPool, tokens: list[int]) -> list[KVCacheBlock]:
    hs = hashes(tokens)
    blocks = pool.get_new_blocks(len(hs))
    pool.cache_full_blocks(blocks, hs, 0, len(hs), BS, tokens)
    return blocks


def test_null_block_is_block_zero_and_never_free() -> None:
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert 0 not in [b.block_id for b in got]


def test_too_small_pool_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_refcounts_and_over_allocation() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1


def test_cache_and_get_cached_block() -> None:
    pool = BlockPool(8)
    tokens = list(range(10))  # 2 full blocks
    blocks = alloc_and_cache(pool, tokens)
    hs = hashes(tokens)
    assert pool.get_cached_block(hs[0]) is blocks[0]
    assert pool.get_cached_block(hs[1]) is blocks[1]
    assert blocks[0].block_hash == hs[0]
    assert pool.get_cached_block(BlockHash(b"nope")) is None


def test_cache_twice_is_an_error() -> None:
    pool = BlockPool(8)
    tokens = list(range(8))
    blocks = alloc_and_cache(pool, tokens)
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_blocks(blocks, hashes(tokens), 0, 2, BS, tokens)


def test_duplicates_of_same_hash_allowed() -> None:
    pool = BlockPool(8)
    tokens = list(range(4))
    a = alloc_and_cache(pool, tokens)
    b = alloc_and_cache(pool, tokens)
    h = hashes(tokens)[0]
    assert pool.get_cached_block(h) in (a[0], b[0])
    pool.free_blocks(a)
    # Evict a's copy: the hash still resolves to b's.
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert pool.get_cached_block(h) is b[0]


def test_free_keeps_cache_until_reallocated_and_touch_hits() -> None:
    pool = BlockPool(8)
    tokens = list(range(8))
    blocks = alloc_and_cache(pool, tokens)
    pool.free_request_blocks(blocks)
    assert [b.ref_cnt for b in blocks] == [0, 0]
    assert pool.get_num_free_blocks() == 7
    hit = pool.get_cached_block(hashes(tokens)[0])
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.get_num_free_blocks() == 6
    assert hit not in pool.free_block_queue
    # touching a block in use only bumps the ref count
    pool.touch([hit])
    assert hit.ref_cnt == 2


def test_free_request_blocks_evicts_tail_first() -> None:
    pool = BlockPool(4)  # 3 usable
    tokens = list(range(12))  # 3 full blocks = whole pool
    blocks = alloc_and_cache(pool, tokens)
    pool.free_request_blocks(blocks)
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [
        blocks[2].block_id,
        blocks[1].block_id,
        blocks[0].block_id,
    ]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[2]
    hs = hashes(tokens)
    assert pool.get_cached_block(hs[2]) is None
    assert pool.get_cached_block(hs[0]) is blocks[0]  # the head is kept


def test_free_blocks_is_in_given_eviction_order() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b, c, a])
    assert pool.free_block_queue.get_all_free_blocks() == [b, c, a]


def test_free_blocks_shared_block_stays_in_use() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk not in pool.free_block_queue
    pool.free_blocks([blk])
    assert blk in pool.free_block_queue
    with pytest.raises(ValueError, match="not in use"):
        pool.free_blocks([blk])


def test_least_recently_freed_is_evicted_first() -> None:
    pool = BlockPool(4)  # 3 usable: a, b and one never-used block
    a = alloc_and_cache(pool, [1, 1, 1, 1])
    b = alloc_and_cache(pool, [2, 2, 2, 2])
    pool.free_request_blocks(a)
    pool.free_request_blocks(b)
    got = pool.get_new_blocks(2)
    assert got[1] is a[0]
    assert pool.get_cached_block(hashes([1, 1, 1, 1])[0]) is None
    assert pool.get_cached_block(hashes([2, 2, 2, 2])[0]) is b[0]


def test_reset_prefix_cache_refuses_while_in_use() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    blocks = alloc_and_cache(pool, list(range(4)))
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(blocks[0].block_hash) is blocks[0]  # type: ignore[arg-type]
    assert pool.take_events() == []
    pool.free_request_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert blocks[0].block_hash is None
    assert pool.cached_block_hash_to_block == {}
    assert pool.take_events() == [AllBlocksCleared()]


def test_events_stored_and_removed() -> None:
    pool = BlockPool(3, enable_kv_cache_events=True)
    tokens = list(range(9))
    hs = hashes(tokens)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hs, 0, 1, BS, tokens, lora_name="ad")
    pool.cache_full_blocks(blocks, hs, 1, 2, BS, tokens)
    ev = pool.take_events()
    assert ev == [
        BlockStored(
            block_hashes=[hs[0]],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name="ad",
            extra_keys=[("ad",)],  # vLLM's untagged per-block form
        ),
        BlockStored(
            block_hashes=[hs[1]],
            parent_block_hash=hs[0],
            token_ids=[4, 5, 6, 7],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            extra_keys=[None],  # vLLM sends one entry per block, None without keys
        ),
    ]
    assert pool.take_events() == []
    pool.free_request_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.take_events() == [BlockRemoved(block_hashes=[hs[1], hs[0]], medium="GPU")]


def test_no_events_when_disabled() -> None:
    pool = BlockPool(3)
    blocks = alloc_and_cache(pool, list(range(8)))
    pool.free_request_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = alloc_and_cache(pool, list(range(8)))
    assert all(b.block_hash is None for b in blocks)
    assert pool.cached_block_hash_to_block == {}


def test_usage() -> None:
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)


def test_alloc_epoch_counts_every_exit_from_the_free_queue() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    assert blk.alloc_epoch == 1
    pool.free_blocks([blk])
    pool.touch([blk])
    assert blk.alloc_epoch == 2
    pool.touch([blk])  # already in use: not an exit from the queue
    assert blk.alloc_epoch == 2
    assert pool.num_allocated_total == 1


def test_freed_empty_block_goes_to_front_cached_to_tail() -> None:
    """vLLM 0.33: an allocation takes a freed empty block before evicting a cached one."""
    pool = BlockPool(6)
    cached = alloc_and_cache(pool, list(range(8)))  # blocks 1, 2: cached
    (partial,) = pool.get_new_blocks(1)  # block 3: a partial tail, never cached
    pool.free_request_blocks([*cached, partial])
    order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert order == [3, 4, 5, 2, 1]
    assert pool.num_prepended_total == 1
    (again,) = pool.get_new_blocks(1)
    assert again is partial
    assert all(pool.get_cached_block(h) is not None for h in hashes(list(range(8))))


def test_caching_disabled_frees_to_front() -> None:
    pool = BlockPool(5, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a, b])
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [1, 2, 3, 4]
