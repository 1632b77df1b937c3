"""Eager stores offer only blocks whose KV is computed, never one that is merely hashed.

A request's block hashes cover its whole prompt from the start (they come from
the tokens), while its KV is computed chunk by chunk. A store of a hashed but
uncomputed block would copy garbage into the tier under a valid key, and every
later hit would read it. Property: across any chunk schedule and block size
factor, every stored offloaded block ``j`` satisfies ``(j + 1) * factor <=
num_computed // block_size`` at the time it is offered, each is offered once,
in chain order, and by the end every computed one was.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.connector import OffloadingConnectorScheduler
from kvoffload.hashing import BlockHash, hash_request_tokens, xxhash64
from kvoffload.offload import CPUOffloadingManager, OffloadKey

from .conftest import BS, Result


def _request(
    num_tokens: int, factor: int = 1
) -> tuple[OffloadingConnectorScheduler, list[KVCacheBlock], list[BlockHash]]:
    pool = BlockPool(64)
    manager = CPUOffloadingManager(64, cache_policy="lru")
    conn = OffloadingConnectorScheduler(pool, manager, BS, block_size_factor=factor)
    tokens = list(range(num_tokens))
    hashes = hash_request_tokens(tokens, BS, xxhash64)
    # The engine allocates the blocks of a chunk as it schedules it; holding
    # them all from the start changes nothing about which are computed.
    blocks = pool.get_new_blocks(-(-num_tokens // BS))
    return conn, blocks, hashes


def _stored_indices(
    conn: OffloadingConnectorScheduler, hashes: list[BlockHash], blocks: list[KVCacheBlock]
) -> list[int]:
    """Offloaded-block indices of the store jobs queued since the last call (settled ok)."""
    index_of: dict[OffloadKey, int] = {
        conn._key(hashes, j): j for j in range(len(hashes) // conn.factor)
    }
    meta = conn.build_connector_meta()
    out: list[int] = []
    for job in meta.stores:
        keys = conn._jobs[job.job_id].keys
        idx = [index_of[k] for k in keys]
        f = conn.factor
        expected_src = [b.block_id for j in idx for b in blocks[j * f : (j + 1) * f]]
        assert list(job.src.block_ids) == expected_src
        out += idx
    conn.update_connector_output([Result(job.job_id) for job in meta.stores])
    return out


def test_mid_chunked_prefill_only_computed_blocks_are_stored() -> None:
    # 6 full blocks hashed, the first chunk computed 2 blocks and 1 token.
    conn, blocks, hashes = _request(6 * BS + 2)
    assert len(hashes) == 6
    conn.on_blocks_computed("a", blocks, hashes, 2 * BS + 1)
    assert _stored_indices(conn, hashes, blocks) == [0, 1]
    # The next chunk ends exactly on a block boundary: that block is computed.
    conn.on_blocks_computed("a", blocks, hashes, 4 * BS)
    assert _stored_indices(conn, hashes, blocks) == [2, 3]
    # One token short of the next boundary: nothing new.
    conn.on_blocks_computed("a", blocks, hashes, 5 * BS - 1)
    assert _stored_indices(conn, hashes, blocks) == []
    conn.on_blocks_computed("a", blocks, hashes, 6 * BS + 2)
    assert _stored_indices(conn, hashes, blocks) == [4, 5]


def test_mid_chunked_prefill_with_block_size_factor() -> None:
    # Offloaded blocks of 2 GPU blocks: 3 GPU blocks computed -> 1 offloaded block.
    conn, blocks, hashes = _request(8 * BS, factor=2)
    conn.on_blocks_computed("a", blocks, hashes, 3 * BS + 3)
    assert _stored_indices(conn, hashes, blocks) == [0]
    conn.on_blocks_computed("a", blocks, hashes, 4 * BS)
    assert _stored_indices(conn, hashes, blocks) == [1]


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    factor = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(1, 14 * BS))
    # Chunk ends: strictly increasing computed counts, the last the whole prompt.
    ends = draw(st.lists(st.integers(1, num_tokens), max_size=8, unique=True))
    return factor, num_tokens, [*sorted(ends), num_tokens]


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_stored_block_is_computed(schedule: tuple[int, int, list[int]]) -> None:
    factor, num_tokens, ends = schedule
    conn, blocks, hashes = _request(num_tokens, factor)
    stored: list[int] = []
    for num_computed in ends:
        conn.on_blocks_computed("a", blocks, hashes, num_computed)
        new = _stored_indices(conn, hashes, blocks)
        for j in new:
            assert (j + 1) * factor <= num_computed // BS, (j, num_computed)
        stored += new
    # Each offloaded block once, in chain order, and every full one by the end.
    assert stored == list(range(num_tokens // BS // factor))
