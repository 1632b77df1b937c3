"""BlockPool against a reference model: ref counts, free order, cache, events.

Requests hold a partial tail block (never cached) as well as their full ones,
so frees exercise both ends of the queue: empty blocks to the front, cached
blocks to the tail (vLLM 0.33's order).
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.blocks import BlockPool
from kvoffload.events import BlockRemoved, BlockStored
from kvoffload.hashing import BlockHash, hash_request_tokens, xxhash64

N = 9
BS = 2


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, enable_kv_cache_events=True)
        self.free: list[int] = list(range(1, N))  # model of the free queue, eviction order
        self.ref = [0] * N
        self.hash_of: dict[int, BlockHash] = {}  # model of block -> cached hash
        self.requests: list[list[int]] = []  # each: block ids held, head first
        self.live_hashes: dict[BlockHash, int] = {}

    def _take(self, bid: int) -> None:
        if self.ref[bid] == 0:
            self.free.remove(bid)
        self.ref[bid] += 1

    @rule(prompt=st.lists(st.integers(0, 3), min_size=BS, max_size=4 * BS))
    def run_request(self, prompt: list[int]) -> None:
        hs = hash_request_tokens(prompt, BS, xxhash64)
        # prefix hit: longest run of cached hashes
        hit = []
        for h in hs:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        n_blocks = -(-len(prompt) // BS)  # the partial tail gets a block too
        need = n_blocks - len(hit)
        touched_free = sum(1 for b in hit if b.ref_cnt == 0)
        if need > len(self.free) - touched_free:
            return
        for b in hit:
            assert self.hash_of.get(b.block_id) == b.block_hash
        self.pool.touch(hit)
        for b in hit:
            self._take(b.block_id)
        new = self.pool.get_new_blocks(need)
        expected = self.free[:need]
        assert [b.block_id for b in new] == expected
        evicted = [self.hash_of.pop(bid) for bid in expected if bid in self.hash_of]
        del self.free[:need]
        for b in new:
            self.ref[b.block_id] += 1
        events = self.pool.take_events()
        if evicted:
            assert events[0] == BlockRemoved(block_hashes=evicted, medium="GPU")
            events = events[1:]
        blocks = hit + new
        self.pool.cache_full_blocks(blocks, hs, len(hit), len(hs), BS, prompt)
        for i in range(len(hit), len(hs)):
            self.hash_of[blocks[i].block_id] = hs[i]
        ev = self.pool.take_events()
        if len(hit) < len(hs):
            assert len(ev) == 1 and isinstance(ev[0], BlockStored)
            assert ev[0].block_hashes == hs[len(hit) :]
            assert ev[0].parent_block_hash == (hs[len(hit) - 1] if hit else None)
        else:
            assert ev == []
        self.requests.append([b.block_id for b in blocks])

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def finish_request(self, i: int) -> None:
        req = self.requests.pop(i % len(self.requests))
        self.pool.free_request_blocks([self.pool.blocks[b] for b in req])
        front: list[int] = []
        tail: list[int] = []
        for bid in reversed(req):
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                (tail if bid in self.hash_of else front).append(bid)
        self.free = front + self.free + tail

    @rule()
    def reset(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.requests)
        if ok:
            self.hash_of.clear()
        self.pool.take_events()

    @invariant()
    def matches_model(self) -> None:
        assert [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()] == self.free
        assert [b.ref_cnt for b in self.pool.blocks[1:]] == self.ref[1:]
        for bid in range(1, N):
            assert self.pool.blocks[bid].block_hash == self.hash_of.get(bid)
        for h in self.hash_of.values():
            assert self.pool.get_cached_block(h) is not None
            assert self.pool.get_cached_block(h).block_hash == h  # type: ignore[union-attr]


TestBlockPoolStateful = BlockPoolMachine.TestCase
TestBlockPoolStateful.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
