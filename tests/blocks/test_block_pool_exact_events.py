"""The GPU tier's events describe the set of hashes held (DESIGN: "What events mean").

A consumer that keeps one entry per hash (a set, as Dynamo's indexer does)
must end up with exactly the hashes the pool holds, after any mix of
prefix hits, duplicate computations (two copies of a hash), evictions and
resets. The per-copy mode stays vLLM 0.33's stream.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.events import BlockRemoved, BlockStored, KVEvent
from kvoffload.hashing import BlockHash, hash_request_tokens, xxhash64

BS = 2


def _apply(index: set[bytes], events: list[KVEvent]) -> None:
    """A set-based consumer: refuses a store of a held hash or a removal of an absent one."""
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                assert h not in index, "announced stored twice"
                index.add(h)  # type: ignore[arg-type]
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in index, "announced removed while not held"
                index.discard(h)  # type: ignore[arg-type]
        else:
            index.clear()


def _held(pool: BlockPool) -> set[bytes]:
    return {b.block_hash for b in pool.blocks if b.block_hash is not None}


def _compute(
    pool: BlockPool, prompt: list[int], use_hit: bool
) -> tuple[list[KVCacheBlock], list[BlockHash]] | None:
    """Run a request's prefill: its prefix hit (unless ``use_hit`` is False) plus new blocks."""
    hashes = hash_request_tokens(prompt, BS, xxhash64)
    hit: list[KVCacheBlock] = []
    if use_hit:
        for h in hashes:
            b = pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
    need = -(-len(prompt) // BS) - len(hit)
    if need > pool.get_num_free_blocks() - sum(1 for b in hit if b.ref_cnt == 0):
        return None
    pool.touch(hit)
    blocks = hit + pool.get_new_blocks(need)
    pool.cache_full_blocks(blocks, hashes, len(hit), len(hashes), BS, prompt)
    return blocks, hashes


def test_second_copy_evicted_announces_nothing() -> None:
    # Two running requests compute the same two blocks (neither saw the other's
    # copy): the set of held hashes has two entries, and losing one copy keeps it.
    pool = BlockPool(6, enable_kv_cache_events=True)
    prompt = [1, 2, 3, 4]
    a = _compute(pool, prompt, use_hit=False)
    b = _compute(pool, prompt, use_hit=False)
    assert a is not None and b is not None
    stored = pool.take_events()
    assert [type(e) for e in stored] == [BlockStored]
    assert stored[0].block_hashes == a[1]  # type: ignore[union-attr]
    pool.free_request_blocks(a[0])
    pool.get_new_blocks(pool.get_num_free_blocks())  # evicts a's copies only
    assert pool.take_events() == []
    pool.free_request_blocks(b[0])
    pool.get_new_blocks(2)  # now the last copies leave
    removed = pool.take_events()
    assert removed == [BlockRemoved(block_hashes=list(reversed(b[1])), medium="GPU")]


def test_per_copy_mode_is_vllms_stream() -> None:
    pool = BlockPool(6, enable_kv_cache_events=True, events_mode="per-copy")
    prompt = [1, 2, 3, 4]
    a = _compute(pool, prompt, use_hit=False)
    b = _compute(pool, prompt, use_hit=False)
    assert a is not None and b is not None
    assert [len(e.block_hashes) for e in pool.take_events()] == [2, 2]  # type: ignore[union-attr]
    pool.free_request_blocks(a[0])
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert pool.take_events() == [BlockRemoved(block_hashes=list(reversed(a[1])), medium="GPU")]


def test_store_run_split_around_held_copy_keeps_chain() -> None:
    # b1 is still held while its parent b0 was evicted: recomputing [b0, b1, b2]
    # announces b0 and b2 only, each with its own parent and tokens.
    pool = BlockPool(8, enable_kv_cache_events=True)
    prompt = [5, 6, 7, 8, 9, 10]
    first = _compute(pool, prompt[:4], use_hit=False)
    assert first is not None
    blocks, h = first
    pool.take_events()
    pool.free_blocks([blocks[0]])  # b1 stays in use
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))  # evicts b0
    assert pool.take_events() == [BlockRemoved(block_hashes=[h[0]], medium="GPU")]
    second = _compute(pool, prompt, use_hit=False)
    assert second is not None
    hashes = second[1]
    assert hashes[:2] == h
    assert pool.take_events() == [
        BlockStored([hashes[0]], None, [5, 6], BS, None, "GPU", None, [None]),
        BlockStored([hashes[2]], hashes[1], [9, 10], BS, None, "GPU", None, [None]),
    ]


def test_unknown_mode_is_one_line() -> None:
    with pytest.raises(ValueError, match="unknown KV events mode 'copies'"):
        BlockPool(4, events_mode="copies")


class ExactEventsMachine(RuleBasedStateMachine):
    """A set fed with the pool's events always equals the hashes the pool holds."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(10, enable_kv_cache_events=True)
        self.index: set[bytes] = set()
        self.tokens: dict[bytes, tuple[int, ...]] = {}  # hash -> its block's tokens
        self.parent: dict[bytes, bytes | None] = {}
        self.running: list[list[KVCacheBlock]] = []
        self.listened: list[KVEvent] = []
        self.pool.event_listeners.append(self.listened.append)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=BS, max_size=4 * BS), hit=st.booleans())
    def run_request(self, prompt: list[int], hit: bool) -> None:
        out = _compute(self.pool, prompt, use_hit=hit)
        if out is None:
            return
        blocks, hashes = out
        for i, h in enumerate(hashes):
            self.tokens[h] = tuple(prompt[i * BS : (i + 1) * BS])
            self.parent[h] = hashes[i - 1] if i else None
        self.running.append(blocks)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        self.pool.free_request_blocks(self.running.pop(i % len(self.running)))

    @rule(n=st.integers(1, 9))
    def allocate_and_free(self, n: int) -> None:
        n = min(n, self.pool.get_num_free_blocks())
        if n:
            self.pool.free_blocks(self.pool.get_new_blocks(n))

    @rule()
    def reset(self) -> None:
        self.pool.reset_prefix_cache()

    @invariant()
    def index_is_exact(self) -> None:
        events = self.pool.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                # Self-consistent chain: parent and tokens are the hashes' own.
                assert ev.parent_block_hash == self.parent[ev.block_hashes[0]]  # type: ignore[index]
                prev = ev.block_hashes[0]
                for h in ev.block_hashes[1:]:
                    assert self.parent[h] == prev  # type: ignore[index]
                    prev = h
                want = [t for h in ev.block_hashes for t in self.tokens[h]]  # type: ignore[index]
                assert ev.token_ids == want
                assert ev.extra_keys == [None] * len(ev.block_hashes)
        _apply(self.index, events)
        assert self.index == _held(self.pool)
        # Listeners see the exact stream too.
        assert self.listened == events
        self.listened.clear()


TestExactEvents = ExactEventsMachine.TestCase
TestExactEvents.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
