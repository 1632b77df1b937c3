"""Lazy offloading: the free-queue walk, its cursor, window and CPU-room limits."""

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.connector import LazyStoreWalker
from kvoffload.hashing import BlockHash

from .conftest import BS, Harness, Result


def cached_free_blocks(pool: BlockPool, n: int) -> list[KVCacheBlock]:
    """``n`` blocks, each cached under its own hash, freed in order."""
    blocks = pool.get_new_blocks(n)
    hs = [BlockHash(bytes([i]) * 8) for i in range(n)]
    for b, h in zip(blocks, hs):
        pool.cache_full_blocks([b], [h], 0, 1, BS)
    pool.free_blocks(blocks)
    return blocks


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_walk_chooses_cached_blocks_up_to_window() -> None:
    pool = BlockPool(11)
    blocks = cached_free_blocks(pool, 10)
    walker = LazyStoreWalker(pool)
    chosen = walker.walk(window=3, max_chosen=100, wants_copy=lambda b: b.block_id % 2 == 1)
    # every other block needs a copy; 3 skipped (safe) blocks fill the window
    assert ids(chosen) == [1, 3, 5]
    assert walker.cursor is blocks[5]  # block 6: the last walked block that stays
    assert walker.handled == 3


def test_walk_resumes_from_cursor_across_steps() -> None:
    pool = BlockPool(11)
    blocks = cached_free_blocks(pool, 10)
    walker = LazyStoreWalker(pool)
    seen: list[int] = []

    def wants(b: KVCacheBlock) -> bool:
        seen.append(b.block_id)
        return False

    walker.walk(3, 10, wants)
    walker.walk(6, 10, wants)
    assert seen == [1, 2, 3, 4, 5, 6]  # each block looked at once, in order
    assert walker.cursor is blocks[5]


def test_cursor_block_chosen_then_taken_out() -> None:
    pool = BlockPool(8)
    cached_free_blocks(pool, 7)
    walker = LazyStoreWalker(pool)
    chosen = walker.walk(3, 10, lambda b: b.block_id == 3)
    assert ids(chosen) == [3]
    cur = walker.cursor
    assert cur is not None and cur.block_id == 4  # never the chosen block
    pool.touch(chosen)  # taken out for its copy
    seen: list[int] = []
    nxt = walker.walk(4, 10, lambda b: seen.append(b.block_id) or False)
    assert nxt == [] and seen == [5]
    assert walker.cursor is not None and walker.cursor.block_id == 5
    assert walker.handled == 4


def test_cursor_reallocated_restarts_at_front() -> None:
    pool = BlockPool(8)
    blocks = cached_free_blocks(pool, 7)
    walker = LazyStoreWalker(pool)
    walker.walk(3, 10, lambda b: False)
    assert walker.cursor is blocks[2]
    pool.get_new_blocks(3)  # pops blocks 1..3 from the front, the cursor with them
    seen: list[int] = []
    walker.walk(2, 10, lambda b: seen.append(b.block_id) or False)
    assert seen == [4, 5]  # the new front, nothing skipped
    assert walker.handled == 2


def test_front_advance_shrinks_handled_without_rescanning() -> None:
    pool = BlockPool(11)
    blocks = cached_free_blocks(pool, 10)
    walker = LazyStoreWalker(pool)
    walker.walk(5, 10, lambda b: False)
    pool.get_new_blocks(2)  # two handled blocks leave the front
    seen: list[int] = []
    walker.walk(5, 10, lambda b: seen.append(b.block_id) or False)
    assert seen == [6, 7]  # only the two needed to refill the window
    assert walker.cursor is blocks[6]


def test_cursor_freed_again_at_tail_is_not_trusted() -> None:
    pool = BlockPool(8)
    blocks = cached_free_blocks(pool, 7)
    walker = LazyStoreWalker(pool)
    walker.walk(3, 10, lambda b: False)
    cursor = walker.cursor
    assert cursor is blocks[2]
    pool.touch([cursor])  # a prefix hit takes it...
    pool.free_blocks([cursor])  # ...and it comes back at the tail
    assert cursor in pool.free_block_queue
    seen: list[int] = []
    walker.walk(4, 10, lambda b: seen.append(b.block_id) or False)
    # resumes after the previous cursor (block 2), not after the tail
    assert seen == [4, 5]


def test_cursor_hit_and_no_fallback_restarts_from_front() -> None:
    pool = BlockPool(6)
    blocks = cached_free_blocks(pool, 5)
    walker = LazyStoreWalker(pool)
    walker.walk(1, 10, lambda b: False)
    assert walker.cursor is blocks[0]
    pool.touch([blocks[0]])
    seen: list[int] = []
    walker.walk(2, 10, lambda b: seen.append(b.block_id) or False)
    assert seen == [2, 3]


def test_max_chosen_limits_and_leaves_rest_for_later() -> None:
    pool = BlockPool(11)
    cached_free_blocks(pool, 10)
    walker = LazyStoreWalker(pool)
    chosen = walker.walk(10, 2, lambda b: True)
    assert ids(chosen) == [1, 2]
    pool.touch(chosen)
    chosen = walker.walk(10, 2, lambda b: True)
    assert ids(chosen) == [3, 4]


def test_lazy_scheduler_end_to_end_room_and_window() -> None:
    h = Harness(num_gpu=12, num_cpu=3, store_mode="lazy")
    blocks = cached_free_blocks(h.pool, 8)
    # eager hook does nothing in lazy mode
    h.conn.on_blocks_computed("x", blocks, [b.block_hash for b in blocks], 8 * BS)
    assert h.conn.build_connector_meta().stores == []
    queued = h.conn.schedule_lazy_stores(window=5)
    assert queued == 3  # limited by CPU room
    (job,) = h.conn.build_connector_meta().stores
    assert list(job.src.block_ids) == [1, 2, 3]
    assert all(h.pool.blocks[i] not in h.pool.free_block_queue for i in (1, 2, 3))
    h.conn.update_connector_output([Result(job.job_id)])
    # after the copy the blocks are free again (at the tail) and on the CPU
    assert all(h.pool.blocks[i] in h.pool.free_block_queue for i in (1, 2, 3))
    assert h.manager.num_stored_blocks() == 3
    # the CPU tier can make room by evicting now: the walk continues at block 4
    queued = h.conn.schedule_lazy_stores(window=5)
    (job,) = h.conn.build_connector_meta().stores
    assert list(job.src.block_ids) == [4, 5, 6]
    h.conn.update_connector_output([Result(job.job_id)])
    h.assert_nothing_held()


def test_empty_blocks_freed_to_front_count_as_handled() -> None:
    """Freed empty blocks go before the cursor: the window already covers them."""
    pool = BlockPool(8)
    empty = pool.get_new_blocks(2)  # blocks 1, 2: in use, nothing cached
    cached_free_blocks(pool, 5)  # blocks 3..7 cached, free: the whole queue
    walker = LazyStoreWalker(pool)
    walker.walk(2, 10, lambda b: False)
    assert walker.handled == 2 and walker.cursor is not None and walker.cursor.block_id == 4
    pool.free_blocks(empty)  # both to the front: 1, 2, 3, 4 | 5, 6, 7
    seen: list[int] = []
    walker.walk(5, 10, lambda b: seen.append(b.block_id) or False)
    assert walker.handled == 5
    assert seen == [5]  # nothing before the cursor is walked again
