"""``OffloadEventDescriber`` against a reference model: one set of hashes per tier.

Managers may report a store of a key the tier already holds, or a removal
of one it does not (the Redis tier's bounded memory, replays of a reset);
the translated stream must still describe exactly the set each tier holds,
and every described store must carry the GPU tier's payload of its hashes.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvoffload.engine.connector.events import RECENTLY_LEFT, OffloadEventDescriber
from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvoffload.offload.base import OffloadingEvent, make_offload_key

BS = 2
MEDIA = ("CPU", "DISK", "REMOTE")
# One chain of 8 blocks: hash i's parent is hash i - 1.
HASHES = [bytes([i + 1]) * 32 for i in range(8)]
TOKENS = {h: (10 * i, 10 * i + 1) for i, h in enumerate(HASHES)}


def _gpu_store(indices: list[int]) -> BlockStored:
    first = indices[0]
    return BlockStored(
        [HASHES[i] for i in indices],
        HASHES[first - 1] if first else None,
        [t for i in indices for t in TOKENS[HASHES[i]]],
        BS,
        None,
        "GPU",
        None,
        [None] * len(indices),
    )


class DescriberMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.describer = OffloadEventDescriber(self_describing=True)
        self.truth: dict[str, set[bytes]] = {m: set() for m in MEDIA}
        self.index: dict[str, set[object]] = {m: set() for m in MEDIA}
        self.pending: list[OffloadingEvent] = []

    @rule(start=st.integers(0, 7), n=st.integers(1, 4))
    def gpu_caches(self, start: int, n: int) -> None:
        self.describer.observe(_gpu_store(list(range(start, min(8, start + n)))))

    @rule(ids=st.lists(st.integers(0, 7), min_size=1, max_size=3))
    def gpu_evicts(self, ids: list[int]) -> None:
        self.describer.observe(BlockRemoved([HASHES[i] for i in ids], "GPU"))

    @rule()
    def gpu_clears(self) -> None:
        self.describer.observe(AllBlocksCleared())

    @rule(
        medium=st.sampled_from(MEDIA),
        ids=st.lists(st.integers(0, 7), min_size=1, max_size=4),
        removed=st.booleans(),
    )
    def tier_reports(self, medium: str, ids: list[int], removed: bool) -> None:
        # Whatever the manager says, true or redundant: the set changes only by it.
        keys = [make_offload_key(HASHES[i]) for i in ids]
        self.pending.append(OffloadingEvent(keys, medium, removed))
        held = self.truth[medium]
        for i in ids:
            (held.discard if removed else held.add)(HASHES[i])

    @invariant()
    def stream_is_each_tiers_set(self) -> None:
        out: list[KVEvent] = self.describer.translate(self.pending)
        self.pending = []
        for ev in out:
            assert isinstance(ev, BlockStored | BlockRemoved)
            held = self.index[str(ev.medium)]
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in held, "removal of a hash not announced"
                    held.discard(h)
                continue
            for h in ev.block_hashes:
                assert h not in held, "second store of an announced hash"
                held.add(h)
            if ev.block_size:
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert tuple(ev.token_ids[i * BS : (i + 1) * BS]) == TOKENS[h]  # type: ignore[index]
                    assert parent == (HASHES[HASHES.index(h) - 1] if h != HASHES[0] else None)  # type: ignore[arg-type]
                    parent = h
                assert ev.kv_cache_spec_kind == "full_attention"
        assert self.index == self.truth
        assert len(self.describer._left) <= RECENTLY_LEFT
        held_keys = {make_offload_key(h) for m in MEDIA for h in self.truth[m]}  # type: ignore[arg-type]
        assert set(self.describer._held) == held_keys


TestDescriber = DescriberMachine.TestCase
TestDescriber.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_not_self_describing_is_the_placeholder_stream() -> None:
    describer = OffloadEventDescriber(self_describing=False)
    describer.observe(_gpu_store([0, 1]))
    keys = [make_offload_key(h) for h in HASHES[:2]]
    out = describer.translate([OffloadingEvent(keys, "CPU", False)])
    assert out == [BlockStored(HASHES[:2], None, [], 0, None, "CPU")]
