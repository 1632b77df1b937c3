import pytest

from kvoffload.blocks import FreeKVCacheBlockQueue, KVCacheBlock


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_initial_order_and_count() -> None:
    _blocks, q = make(5)
    assert q.num_free_blocks == 5
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]


def test_popleft_is_front_and_clears_links() -> None:
    blocks, q = make(3)
    b = q.popleft()
    assert b is blocks[0]
    assert b.prev_free_block is None and b.next_free_block is None
    assert q.num_free_blocks == 2
    assert ids(q.get_all_free_blocks()) == [1, 2]


def test_popleft_empty_raises_value_error() -> None:
    _, q = make(1)
    q.popleft()
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    assert q.num_free_blocks == 0
    assert q.get_all_free_blocks() == []


def test_popleft_n() -> None:
    _blocks, q = make(6)
    got = q.popleft_n(4)
    assert ids(got) == [0, 1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert ids(q.get_all_free_blocks()) == [4, 5]
    assert q.popleft_n(0) == []
    with pytest.raises(ValueError):
        q.popleft_n(3)
    assert ids(q.get_all_free_blocks()) == [4, 5]
    assert ids(q.popleft_n(2)) == [4, 5]
    assert q.num_free_blocks == 0


def test_remove_middle_front_back() -> None:
    blocks, q = make(5)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3]
    assert q.num_free_blocks == 2
    assert blocks[2] not in q and blocks[1] in q


def test_remove_not_in_queue_raises_and_keeps_queue() -> None:
    blocks, q = make(3)
    q.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free block queue"):
        q.remove(blocks[1])
    assert ids(q.get_all_free_blocks()) == [0, 2]
    assert q.num_free_blocks == 2


def test_append_goes_to_tail_and_rejects_member() -> None:
    blocks, q = make(3)
    b = q.popleft()
    q.append(b)
    assert ids(q.get_all_free_blocks()) == [1, 2, 0]
    with pytest.raises(ValueError, match="already"):
        q.append(blocks[1])
    assert ids(q.get_all_free_blocks()) == [1, 2, 0]


def test_append_n_keeps_order_and_rejects_member_consistently() -> None:
    blocks, q = make(4)
    got = q.popleft_n(3)
    q.append_n(list(reversed(got)))
    assert ids(q.get_all_free_blocks()) == [3, 2, 1, 0]
    extra = KVCacheBlock(9)
    with pytest.raises(ValueError):
        q.append_n([extra, blocks[3]])
    # The blocks linked before the bad one stay consistently in the queue.
    assert ids(q.get_all_free_blocks()) == [3, 2, 1, 0, 9]
    assert q.num_free_blocks == 5


def test_iter_blocks_after_none_is_from_front() -> None:
    _, q = make(4)
    assert ids(list(q.iter_blocks_after(None))) == [0, 1, 2, 3]


def test_iter_blocks_after_cursor() -> None:
    blocks, q = make(5)
    assert ids(list(q.iter_blocks_after(blocks[1]))) == [2, 3, 4]
    assert list(q.iter_blocks_after(blocks[4])) == []


def test_iter_blocks_after_cursor_not_in_queue_raises_eagerly() -> None:
    blocks, q = make(3)
    q.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the queue"):
        q.iter_blocks_after(blocks[1])
    stranger = KVCacheBlock(7)
    with pytest.raises(ValueError):
        q.iter_blocks_after(stranger)


def test_iter_blocks_after_sentinel_raises() -> None:
    _, q = make(2)
    with pytest.raises(ValueError):
        q.iter_blocks_after(q._head)
    with pytest.raises(ValueError):
        q.iter_blocks_after(q._tail)


def test_iter_allows_removing_the_yielded_block() -> None:
    _blocks, q = make(5)
    seen = []
    for b in q.iter_blocks_after(None):
        seen.append(b.block_id)
        if b.block_id % 2 == 0:
            q.remove(b)
    assert seen == [0, 1, 2, 3, 4]
    assert ids(q.get_all_free_blocks()) == [1, 3]


def test_iter_sees_blocks_appended_at_tail_during_walk() -> None:
    blocks, q = make(3)
    extra = KVCacheBlock(3)
    it = q.iter_blocks_after(blocks[1])
    q.append(extra)
    assert ids(list(it)) == [2, 3]


def test_empty_queue_iter_is_empty() -> None:
    _, q = make(0)
    assert list(q.iter_blocks_after(None)) == []
    assert len(q) == 0


def test_prepend_n_puts_blocks_at_front_in_order() -> None:
    blocks, q = make(6)
    taken = q.popleft_n(3)  # 0, 1, 2 out; 3, 4, 5 left
    q.prepend_n([taken[2], taken[0]])
    assert ids(q.get_all_free_blocks()) == [2, 0, 3, 4, 5]
    assert q.num_free_blocks == 5
    assert q.popleft() is blocks[2]
    q.prepend_n([])
    assert ids(q.get_all_free_blocks()) == [0, 3, 4, 5]


def test_prepend_n_into_empty_queue_and_rejects_members_without_change() -> None:
    blocks, q = make(3)
    q.popleft_n(3)
    q.prepend_n([blocks[1]])
    assert ids(q.get_all_free_blocks()) == [1]
    with pytest.raises(ValueError):
        q.prepend_n([blocks[0], blocks[1]])  # 1 is a member: nothing changes
    with pytest.raises(ValueError):
        q.prepend_n([blocks[0], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [1]
    assert blocks[0].prev_free_block is None
    q.append(blocks[2])
    assert ids(list(q.iter_blocks_after(None))) == [1, 2]
