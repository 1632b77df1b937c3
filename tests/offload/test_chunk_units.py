"""The unit layer: group layouts, the room count, dead windowed keys first, hits kept whole."""

import pytest

from kvoffload.offload import CPUOffloadingManager, OffloadKey, policy_names
from kvoffload.offload.chunk_units import ChunkUnitPolicy, GroupLayout
from kvoffload.offload.policies import make_policy
from tests.offload.keyutil import key

FULL = GroupLayout()
SW48 = GroupLayout("sliding_window", 48, 16)  # a hit needs the 3 chunks before it
TWO_FULL = (FULL, FULL)
HYBRID = (FULL, SW48)


def chunk(i: int, groups: int = 2) -> list[OffloadKey]:
    return [key(i, g) for g in range(groups)]


def chain(ids: range | list[int], groups: int = 2) -> list[OffloadKey]:
    """vLLM's store order: every chunk of group 0, then every chunk of group 1, ..."""
    return [key(i, g) for g in range(groups) for i in ids]


def store(m: CPUOffloadingManager, keys: list[OffloadKey]) -> list[OffloadKey]:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out.evicted_keys


def hits(m: CPUOffloadingManager, ids: list[int], groups: int = 2) -> int:
    """Chunks that still hit: every group's key held."""
    return sum(all(m.is_stored(k) for k in chunk(i, groups)) for i in ids)


# -- layout ---------------------------------------------------------------------


def test_group_layout_reach() -> None:
    assert FULL.reach_chunks is None
    assert SW48.reach_chunks == 3
    assert GroupLayout("sliding_window", 128, 16).reach_chunks == 8
    assert GroupLayout("sliding_window", 129, 16).reach_chunks == 9
    assert GroupLayout("sliding_window", 1024, 512).reach_chunks == 2
    assert GroupLayout("chunked_local", 64, 16).reach_chunks == 4
    assert GroupLayout("mamba").reach_chunks == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"kind": "linear"}, {"kind": "sliding_window"}, {"tokens_per_chunk": 0}],
)
def test_group_layout_refuses_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GroupLayout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [None, (), (FULL,), (SW48,)])
def test_one_group_keeps_the_per_key_policy(layout: tuple[GroupLayout, ...] | None) -> None:
    m = CPUOffloadingManager(8, "lru", group_layout=layout)
    assert type(m.policy) is type(make_policy("lru", 8))
    assert m._units is None


def test_reset_keeps_the_unit_layer() -> None:
    m = CPUOffloadingManager(8, "lru", group_layout=HYBRID)
    store(m, chain(range(2)))
    assert m.reset_cache()
    assert isinstance(m.policy, ChunkUnitPolicy) and m._units is m.policy
    assert len(m.policy) == 0 and m.num_room_blocks() == 8


# -- hits a per-key policy loses ---------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_per_key_eviction_loses_hits_the_unit_layer_keeps(policy: str) -> None:
    """Two chunks of two groups fill 4 slots; a GPU hit touches chunk 1's group-0 key.

    A per-key policy evicts the two least recently used keys, one of each chunk
    (group 1's keys were never touched): both chunks stop hitting. Chunks as
    units: chunk 2 goes whole, chunk 1 still hits.
    """
    results = {}
    for layout in (None, TWO_FULL):
        m = CPUOffloadingManager(4, policy, group_layout=layout)
        store(m, chunk(1))
        store(m, chunk(2))
        m.touch([key(1, 0)])
        store(m, chunk(3))
        results[layout is not None] = hits(m, [1, 2])
    assert results == {False: 0, True: 1}


def test_unit_layer_hits_at_least_per_key_on_a_replay() -> None:
    """A small replay of overlapping prompts (2 groups, LRU): units never hit less."""
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(6) * 100 + j for j in range(rng.randrange(2, 7))] for _ in range(6)]
    totals = {}
    for layout in (None, TWO_FULL):
        m = CPUOffloadingManager(10, "lru", group_layout=layout)
        got = 0
        for _ in range(300):
            p = prompts[rng.randrange(len(prompts))]
            n = 0
            while n < len(p) and all(m.is_stored(k) for k in chunk(p[n])):
                n += 1
            got += n
            m.touch([k for i in p[:n] for k in chunk(i)])
            store(m, chain(p[n:]))
        totals[layout is not None] = got
    assert totals[True] >= totals[False]


# -- the room count ------------------------------------------------------------------


def test_room_excludes_every_key_of_a_chunk_being_read() -> None:
    m = CPUOffloadingManager(6, "lru", group_layout=TWO_FULL)
    store(m, chunk(1))
    store(m, chunk(2))
    assert m.num_room_blocks() == 6
    m.prepare_load([key(1, 0)])
    # Per key, 3 keys are evictable; evicting key(1, 1) would lose chunk 1's hit.
    assert m.num_evictable_blocks() == 2
    assert m.num_room_blocks() == 2 + 2
    m.complete_load([key(1, 0)])
    assert m.num_room_blocks() == 6


def test_room_excludes_a_chunk_with_a_key_being_stored() -> None:
    m = CPUOffloadingManager(6, "lru", group_layout=TWO_FULL)
    store(m, [key(1, 0)])
    store(m, chunk(2))
    out = m.prepare_store([key(1, 1)])
    assert out is not None and out.keys_to_store == [key(1, 1)]
    assert m.num_room_blocks() == 2 + 2  # two free slots, chunk 2 (not chunk 1: it is busy)
    m.complete_store(out.keys_to_store, success=False)
    assert m.num_room_blocks() == 3 + 3


def test_store_is_refused_rather_than_split_a_busy_chunk() -> None:
    m = CPUOffloadingManager(4, "lru", group_layout=TWO_FULL)
    store(m, chunk(1))
    store(m, chunk(2))
    m.prepare_load([key(1, 1)])
    m.prepare_load([key(2, 0)])
    assert m.num_room_blocks() == 0
    assert m.prepare_store(chunk(3)) is None
    assert hits(m, [1, 2]) == 2 and m.num_free_blocks() == 0
    m.complete_load([key(2, 0)])
    assert m.prepare_store(chunk(3)) is not None
    assert hits(m, [1]) == 1


def test_a_chunk_is_not_evicted_for_its_own_other_group() -> None:
    """Storing group 1's key of chunk 1 must not make room by evicting chunk 1's group 0 key."""
    m = CPUOffloadingManager(3, "lru", group_layout=TWO_FULL)
    store(m, [key(1, 0)])
    store(m, chunk(2))  # chunk 2 is now the most recent: LRU would pick chunk 1
    victims = store(m, [key(1, 1)])
    assert set(victims) == set(chunk(2))
    assert hits(m, [1]) == 1


def test_whole_chunk_victims_may_exceed_the_need_by_less_than_a_chunk() -> None:
    m = CPUOffloadingManager(4, "lru", group_layout=TWO_FULL)
    store(m, chunk(1))
    store(m, chunk(2))
    victims = store(m, [key(3, 0)])
    assert set(victims) == set(chunk(1))
    assert m.num_free_blocks() == 1


# -- windowed groups: keys out of reach go first ----------------------------------------


def test_sliding_window_keys_out_of_reach_go_first() -> None:
    """A prompt of 8 chunks: hits at its end (8) and one chunk earlier (7) need chunks 4-7."""
    m = CPUOffloadingManager(16, "lru", group_layout=HYBRID)
    store(m, chain(range(8)))
    units = m.policy
    assert isinstance(units, ChunkUnitPolicy)
    assert units.dead_keys() == [key(i, 1) for i in range(4)]
    assert m.num_room_blocks() == 16
    victims = store(m, chain(range(100, 103)))  # 6 keys, 0 free slots
    assert victims == [key(i, 1) for i in range(4)] + [key(7, 0), key(7, 1)]
    # Every full-attention key of the prompt before chunk 7 is still held.
    assert all(m.is_stored(key(i, 0)) for i in range(7))


def test_a_lookup_that_stops_mid_chain_keeps_the_window_before_it() -> None:
    """A request that diverges after chunk 3: the window keys of chunks 1-3 are reachable now."""
    m = CPUOffloadingManager(16, "lru", group_layout=HYBRID)
    store(m, chain(range(8)))
    assert m.lookup([key(i, 0) for i in [0, 1, 2, 3, 50]]) == 4
    units = m.policy
    assert isinstance(units, ChunkUnitPolicy)
    assert units.dead_keys() == [key(0, 1)]


def test_a_store_continuing_a_stored_chain_marks_its_boundary() -> None:
    """vLLM-style: the next turn looks up, hits 8 chunks, and stores chunks 8-9 only."""
    m = CPUOffloadingManager(32, "lru", group_layout=HYBRID)
    store(m, chain(range(8)))
    assert m.lookup([key(i, 0) for i in range(10)]) == 8
    store(m, chain(range(8, 10)))
    units = m.policy
    assert isinstance(units, ChunkUnitPolicy)
    # The first turn's end (chunks 4-7) and the second's (8, 9) stay reachable.
    assert units.dead_keys() == [key(i, 1) for i in range(4)]


def test_a_dead_key_that_is_read_is_kept_again() -> None:
    m = CPUOffloadingManager(16, "lru", group_layout=HYBRID)
    store(m, chain(range(8)))
    m.prepare_load([key(2, 1)])
    units = m.policy
    assert isinstance(units, ChunkUnitPolicy)
    assert key(2, 1) not in units.dead_keys() and not units.is_dead(key(2, 1))
    m.complete_load([key(2, 1)])
    assert key(2, 1) not in units.dead_keys()


def test_mamba_keeps_only_the_state_at_each_boundary() -> None:
    m = CPUOffloadingManager(16, "lru", group_layout=(FULL, GroupLayout("mamba")))
    store(m, chain(range(6)))
    units = m.policy
    assert isinstance(units, ChunkUnitPolicy)
    assert units.dead_keys() == [key(i, 1) for i in range(4)]


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_runs_under_the_unit_layer(policy: str) -> None:
    m = CPUOffloadingManager(12, policy, group_layout=HYBRID)
    for base in range(0, 60, 6):
        keys = chain(range(base, base + 4))
        flags = m.admit(keys)
        if flags is not None:
            keys = [k for k, f in zip(keys, flags) if f]
            # A chunk is admitted or declined whole.
            for i in range(base, base + 4):
                assert (key(i, 0) in keys) == (key(i, 1) in keys)
        if keys:
            out = m.prepare_store(keys)
            assert out is not None
            m.complete_store(out.keys_to_store)
        m.hint_queued("r", chain(range(base, base + 2)))
        m.touch(chain(range(base, base + 2)))
        m.hint_dequeued("r")
    assert len(m.policy) == m.num_stored_blocks() <= 12


def test_a_queued_request_keeps_the_window_its_hit_needs() -> None:
    """A queued request shares chunks 0-3 of a stored prompt: its hit needs chunks 1-3's window."""
    m = CPUOffloadingManager(24, "lru", group_layout=HYBRID)
    store(m, chain(range(12)))
    m.hint_queued("r", [key(i, 0) for i in [0, 1, 2, 3, 60, 61]] + [key(i, 1) for i in [0, 1]])
    units = m.policy
    assert isinstance(units, ChunkUnitPolicy)
    # Chunks 1-3 before the request's boundary, 8-11 before the prompt's end stay.
    assert units.dead_keys() == [key(i, 1) for i in (0, 4, 5, 6, 7)]
