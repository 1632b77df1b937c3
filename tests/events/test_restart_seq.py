"""Restart-safe seqs: a restarted engine's stream is newer than its earlier incarnation's.

Dynamo's indexer keeps the last seq of each instance and drops batches at or
below it; an engine whose seqs restarted at 0 would be ignored until it
passed the old count. Engines start at ``restart_safe_first_seq()``, above
any seq an incarnation started a second earlier can have reached, and
kvoffload's own subscriber reads that start as the stream's beginning.
"""

from __future__ import annotations

from kvoffload.events import AllBlocksCleared, BlockStored
from kvoffload.events.publisher import restart_safe_first_seq
from kvoffload.events.subscriber import DEFAULT_MAX_GAP, KVEventSubscriber
from tests.events.conftest import HANG_GUARD_S, PublisherFactory


def test_a_restart_a_second_later_starts_above_everything_before() -> None:
    t = 1_800_000_000.0
    earlier = restart_safe_first_seq(t)
    # Even a million batches a second for a day stays below the next start.
    assert earlier + 86_400 * 10**6 < restart_safe_first_seq(t + 86_400 + 1)
    assert restart_safe_first_seq(t + 1) - earlier > DEFAULT_MAX_GAP  # a resync, not a gap
    assert restart_safe_first_seq(t + 30 * 365 * 86_400) < 1 << 63  # good until 2059


def test_a_seq_keeping_router_applies_the_restarts_clear() -> None:
    # A consumer that drops seqs <= the last one it applied (as Dynamo does).
    last = -1
    applied: list[str] = []
    for first, what in (
        (restart_safe_first_seq(1.8e9), "old"),
        (restart_safe_first_seq(1.8e9 + 5), "new"),
    ):
        for i, event in enumerate([AllBlocksCleared(), what]):
            seq = first + i
            if seq > last:
                applied.append(type(event).__name__ if not isinstance(event, str) else event)
                last = seq
    assert applied == ["AllBlocksCleared", "old", "AllBlocksCleared", "new"]


def test_catching_up_from_seq_0_reports_nothing_lost(make_pub: PublisherFactory) -> None:
    pub = make_pub(first_seq=restart_safe_first_seq())
    first = pub.next_seq
    for i in range(3):
        pub.publish([BlockStored([bytes([i + 1]) * 32], None, [1, 2], 2, None, "GPU")])
    assert pub.flush(120.0)
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as sub:
        got: list[int] = []
        for _ in range(int(HANG_GUARD_S / 0.2)):
            got += [r.seq for r in sub.recv(0.2)]
            if len(got) == 3:
                break
        assert got == [first, first + 1, first + 2]
        assert sub.lost_ranges == [] and sub.stats.lost_batches == 0
