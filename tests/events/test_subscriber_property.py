"""Property: whatever live batches are dropped, the subscriber accounts for every seq once.

A scripted publisher sends seqs 0..N live with a random subset dropped, and its
replay socket holds only the last ``buffer`` of them. Reference model: a
dropped seq is handed out (replayed) iff the replay buffer still holds it,
else it is reported lost; every other seq is handed out live; each seq from the
first live one on is handed out or lost exactly once, in increasing order; a
seq that was not dropped is never lost (it may come by replay first).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.events.subscriber import KVEventSubscriber, ReceivedBatch
from kvoffload.events.types import BlockRemoved, KVEventBatch, encode_batch
from tests.events.conftest import TOPIC, FakePublisher


def _payload(seq: int, profile: str) -> bytes:
    batch = KVEventBatch(ts=float(seq), events=[BlockRemoved([seq.to_bytes(32, "big")], "GPU")])
    return encode_batch(batch, profile)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, set[int], int, str, str]:
    n = draw(st.integers(2, 40))
    # The last seq is always delivered, so that every gap is revealed.
    dropped = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    buffer = draw(st.integers(0, n))
    profile = draw(st.sampled_from(["vllm", "legacy"]))
    framing = draw(st.sampled_from(["vllm", "legacy"]))
    return n, dropped, buffer, profile, framing


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_seq_is_handed_out_or_lost_exactly_once(
    scenario: tuple[int, set[int], int, str, str],
) -> None:
    n, dropped, buffer, profile, framing = scenario
    in_buffer = set(range(n + 1 - buffer, n + 1))
    fake = FakePublisher([(s, _payload(s, profile)) for s in sorted(in_buffer)], framing=framing)
    got: list[ReceivedBatch] = []
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, replay_timeout_s=30.0
        ) as sub:
            fake.wait_subscriber()
            for s in range(n + 1):
                if s not in dropped:
                    fake.send(s, _payload(s, profile))
            while not got or got[-1].seq < n:
                batch = sub.recv(30.0)
                assert batch, "stalled"
                got.extend(batch)
    finally:
        fake.close()
    first = min(set(range(n + 1)) - dropped)
    seqs = [r.seq for r in got]
    lost = [s for a, b in sub.lost_ranges for s in range(a, b + 1)]
    assert seqs == sorted(set(seqs))
    assert sorted(seqs + lost) == list(range(first, n + 1))
    expected_handed = {s for s in range(first, n + 1) if s not in dropped or s in in_buffer}
    assert set(seqs) == expected_handed
    for r in got:
        if r.seq in dropped:
            assert r.replayed
        if r.replayed:  # a live seq may come by replay first, from the buffer
            assert r.seq in in_buffer
        assert r.batch.ts == float(r.seq)
        assert r.profile == profile
    assert sub.stats.lost_batches == len(lost)


@st.composite
def restarts(draw: st.DrawFn) -> tuple[int, set[int], int, set[int], int]:
    n1 = draw(st.integers(1, 30))
    dropped1 = draw(st.sets(st.integers(0, n1 - 1), max_size=n1 - 1))
    # The new incarnation's seqs stay at or below the old one's last seq, so
    # that its first batch is recognisably a step back.
    n2 = draw(st.integers(1, n1))
    dropped2 = draw(st.sets(st.integers(0, n2 - 1), max_size=n2 - 1))
    buffer = draw(st.integers(0, n2 + 1))
    return n1, dropped1, n2, dropped2, buffer


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(restarts())
def test_publisher_restart_starts_a_new_fully_accounted_epoch(
    scenario: tuple[int, set[int], int, set[int], int],
) -> None:
    n1, dropped1, n2, dropped2, buffer = scenario
    old = [(s, _payload(s, "vllm")) for s in range(n1 + 1)]
    fake = FakePublisher(old)
    notices: list[str] = []

    def new_payload(seq: int) -> bytes:
        batch = KVEventBatch(ts=1000.0 + seq, events=[])
        return encode_batch(batch)

    in_buffer = set(range(n2 + 1 - buffer, n2 + 1))
    got: list[ReceivedBatch] = []
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, replay_timeout_s=30.0,
            on_notice=notices.append,
        ) as sub:  # fmt: skip
            fake.wait_subscriber()
            for s in range(n1 + 1):
                if s not in dropped1:
                    fake.send(s, old[s][1])
            while not got or got[-1].seq < n1:
                batch = sub.recv(15.0)
                assert batch, (
                    f"stalled in the first epoch: {scenario} {[(r.epoch, r.seq) for r in got]}"
                )
                got.extend(batch)
            lost_first = list(sub.lost_ranges)
            fake._answers = [(s, new_payload(s)) for s in sorted(in_buffer)]
            for s in range(n2 + 1):
                if s not in dropped2:
                    fake.send(s, new_payload(s))
            while not got or (got[-1].epoch, got[-1].seq) < (1, n2):
                batch = sub.recv(15.0)
                assert batch, (
                    f"stalled in the second epoch: {scenario} "
                    f"{[(r.epoch, r.seq) for r in got]} {sub.stats}"
                )
                got.extend(batch)
    finally:
        fake.close()
    first = [r for r in got if r.epoch == 0]
    second = [r for r in got if r.epoch == 1]
    assert len(first) + len(second) == len(got)
    assert sub.stats.resyncs == 1 and sub.epoch == 1
    assert any("resynchronising" in n for n in notices)
    start1 = min(set(range(n1 + 1)) - dropped1)
    lost1 = [s for a, b in lost_first for s in range(a, b + 1)]
    assert sorted([r.seq for r in first] + lost1) == list(range(start1, n1 + 1))
    assert all(r.batch.ts == float(r.seq) for r in first)
    start2 = min(set(range(n2 + 1)) - dropped2)
    lost2 = [s for a, b in sub.lost_ranges[len(lost_first) :] for s in range(a, b + 1)]
    seqs2 = [r.seq for r in second]
    assert seqs2 == sorted(set(seqs2))
    assert sorted(seqs2 + lost2) == list(range(start2, n2 + 1))
    assert set(seqs2) == {s for s in range(start2, n2 + 1) if s not in dropped2 or s in in_buffer}
    assert all(r.batch.ts == 1000.0 + r.seq for r in second)
