"""Property: whatever live batches are dropped, the subscriber accounts for every seq once.

A scripted publisher sends seqs 0..N live with a random subset dropped, and its
replay socket holds only the last ``buffer`` of them. Reference model: a
dropped seq is handed out (replayed) iff the replay buffer still holds it,
else it is reported lost; every other seq is handed out live; each seq from the
first live one on is handed out or lost exactly once, in increasing order; a
seq that was not dropped is never lost (it may come by replay first).
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.events.subscriber import KVEventSubscriber, ReceivedBatch
from kvoffload.events.types import BlockRemoved, KVEventBatch, encode_batch
from tests.events.conftest import TOPIC, FakePublisher, collect_until


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
            live = [s for s in range(n + 1) if s not in dropped]
            for s in live:
                fake.send(s, _payload(s, profile))
            got = collect_until(sub, lambda out: any(r.seq == n for r in out), len(live))
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
def restarts(draw: st.DrawFn) -> tuple[int, int, set[int], int, set[int], int, bool]:
    n1 = draw(st.integers(1, 30))
    # The first incarnation's live stream goes out in two parts: seqs up to
    # ``cut``, then (once those are handed out) the rest. A gap in the first
    # part makes the replay hand out the later seqs too, so their live copies
    # come late, after the replay: duplicates that still move the stream on.
    cut = draw(st.integers(0, n1))
    # The end of each part is delivered, so that every gap is revealed.
    dropped1 = draw(st.sets(st.integers(0, n1 - 1), max_size=n1 - 1)) - {cut}
    # The new incarnation's seqs stay at or below the old one's last seq, so
    # that its first batch is recognisably a step back; the subscriber may
    # miss its first ``skip2`` batches (it joins late), so the new epoch can
    # start above the live seq that revealed a gap.
    n2 = draw(st.integers(1, n1))
    skip2 = draw(st.integers(0, n2))
    dropped2 = set(range(skip2)) | draw(st.sets(st.integers(0, n2), max_size=n2))
    dropped2.discard(n2)
    buffer = draw(st.integers(0, n2 + 1))
    # The new incarnation may even send byte-identical batches: then only the
    # live seqs seen tell its step back from late live copies.
    same_payloads = draw(st.booleans())
    return n1, cut, dropped1, n2, dropped2, buffer, same_payloads


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(restarts())
def test_publisher_restart_starts_a_new_fully_accounted_epoch(
    scenario: tuple[int, int, set[int], int, set[int], int, bool],
) -> None:
    n1, cut, dropped1, n2, dropped2, buffer, same_payloads = scenario
    old = [(s, _payload(s, "vllm")) for s in range(n1 + 1)]
    fake = FakePublisher(old)
    notices: list[str] = []

    new_ts = 0.0 if same_payloads else 1000.0

    def new_payload(seq: int) -> bytes:
        if same_payloads:
            return old[seq][1]
        return encode_batch(KVEventBatch(ts=new_ts + seq, events=[]))

    in_buffer = set(range(n2 + 1 - buffer, n2 + 1))
    got: list[ReceivedBatch] = []
    sent = 0

    def send(seqs: range, dropped: set[int], payload: Callable[[int], bytes]) -> None:
        nonlocal sent
        for s in seqs:
            if s not in dropped:
                fake.send(s, payload(s))
                sent += 1

    def reached(epoch: int, seq: int) -> Callable[[list[ReceivedBatch]], bool]:
        return lambda out: any((r.epoch, r.seq) >= (epoch, seq) for r in got + out)

    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, replay_timeout_s=30.0,
            on_notice=notices.append,
        ) as sub:  # fmt: skip
            fake.wait_subscriber()
            send(range(cut + 1), dropped1, lambda s: old[s][1])
            got += collect_until(sub, reached(0, cut), sent)
            send(range(cut + 1, n1 + 1), dropped1, lambda s: old[s][1])
            got += collect_until(sub, reached(0, n1), sent)
            lost_first = list(sub.lost_ranges)
            fake._answers = [(s, new_payload(s)) for s in sorted(in_buffer)]
            send(range(n2 + 1), dropped2, new_payload)
            got += collect_until(sub, reached(1, n2), sent)
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
    assert all(r.batch.ts == new_ts + r.seq for r in second)
