"""Subscriber and publisher against broken or hostile peers, and tier media in both profiles.

Scripted peers (``FakePublisher``) send exact seqs, so each case is deterministic;
timeouts below are hang guards, never timing assertions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import zmq

from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.events.subscriber import KVEventSubscriber, ReceivedBatch
from kvoffload.events.types import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    MEDIUM_STORAGE,
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    kvoffload_medium,
    vllm_block_hash,
)
from tests.events.conftest import (
    LOOPBACK_ANY,
    TOPIC,
    FakePublisher,
    PublisherFactory,
    collect_until,
    wait_subscribed,
)

GUARD_S = 30.0


def _payload(seq: int, profile: str = "vllm", ts: float | None = None) -> bytes:
    batch = KVEventBatch(
        ts=float(seq) if ts is None else ts,
        events=[BlockRemoved([seq.to_bytes(32, "big")], "CPU")],
    )
    return encode_batch(batch, profile)


def _collect_until(
    sub: KVEventSubscriber, seq: int, epoch: int = 0, guard_s: float = GUARD_S
) -> list[ReceivedBatch]:
    out: list[ReceivedBatch] = []
    while not any(r.seq == seq and r.epoch == epoch for r in out):
        got = sub.recv(guard_s)
        assert got, f"stalled after {[(r.seq, r.epoch) for r in out[-3:]]}"
        out.extend(got)
    return out


def _has(seq: int, epoch: int = 0) -> Callable[[list[ReceivedBatch]], bool]:
    return lambda out: any(r.seq == seq and r.epoch == epoch for r in out)


# -- resynchronisation -------------------------------------------------------------


def test_publisher_restart_seq_back_to_zero_resyncs_with_a_message() -> None:
    fake = FakePublisher([])
    notices: list[str] = []
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, on_notice=notices.append
        ) as sub:
            fake.wait_subscriber()
            for s in range(10):
                fake.send(s, _payload(s))
            first = collect_until(sub, _has(9), 10)
            # A new incarnation: seqs from 0 again, other payloads.
            for s in range(30):
                fake.send(s, _payload(s, ts=1000.0 + s))
            second = collect_until(sub, _has(29, epoch=1), 40)
    finally:
        fake.close()
    assert [(r.seq, r.epoch) for r in first] == [(s, 0) for s in range(10)]
    assert [(r.seq, r.epoch) for r in second] == [(s, 1) for s in range(30)]
    assert [r.batch.ts for r in second] == [1000.0 + s for s in range(30)]
    assert sub.stats.resyncs == 1
    assert sub.lost_ranges == []
    assert fake.requests == []
    assert any("went back from 10 to 0" in n and "resynchronising" in n for n in notices)


@pytest.mark.parametrize("new_payloads", ["other", "same"])
def test_restart_after_live_copies_of_replayed_batches_resyncs(new_payloads: str) -> None:
    # Seqs 0..9 come by the start_seq catch-up replay, then live again (copies,
    # skipped), then a restarted publisher sends 0..3. Live copies must advance
    # the live high-water mark: otherwise 0..3 pass for more copies and the new
    # incarnation is never delivered. With "same" payloads only that mark can
    # tell the restart from copies.
    old = [(s, _payload(s)) for s in range(10)]
    ts = {"other": 1000.0, "same": 0.0}[new_payloads]
    new = [(s, _payload(s, ts=ts + s)) for s in range(4)]
    fake = FakePublisher(old)
    notices: list[str] = []
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, start_seq=0, on_notice=notices.append
        ) as sub:
            fake.wait_subscriber()
            for seq, payload in old + new:
                fake.send(seq, payload)
            got = collect_until(
                sub, lambda out: any(r.epoch == 1 and r.seq == 3 for r in out), len(old + new)
            )
    finally:
        fake.close()
    assert [(r.epoch, r.seq, r.replayed) for r in got] == [(0, s, True) for s in range(10)] + [
        (1, s, False) for s in range(4)
    ]
    assert [r.batch.ts for r in got] == [float(s) for s in range(10)] + [ts + s for s in range(4)]
    assert sub.stats.resyncs == 1 and sub.epoch == 1
    assert sub.stats.duplicates == 10
    assert sub.lost_ranges == []
    assert fake.requests == [0]
    assert sum("resynchronising" in n for n in notices) == 1


def test_absurd_seq_does_not_silence_the_stream() -> None:
    fake = FakePublisher([])
    notices: list[str] = []
    absurd = 2**64 - 2
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, on_notice=notices.append
        ) as sub:
            fake.wait_subscriber()
            for s in range(101):
                fake.send(s, _payload(s))
            fake.send(absurd, _payload(7))
            for s in range(101, 121):
                fake.send(s, _payload(s))
            got = collect_until(sub, _has(120, epoch=2), 122)
    finally:
        fake.close()
    later = [r.seq for r in got if r.epoch == 2]
    assert later == list(range(101, 121))
    assert [r.seq for r in got if r.epoch == 0] == list(range(101))
    assert sub.stats.resyncs == 2
    # One replay from the old stream's next seq (a restarted publisher's missed
    # first batches would be there; this buffer is bounded), none of the 2**64
    # seqs below the jump is counted lost.
    assert fake.requests == [101]
    assert sub.stats.lost_batches == 0
    assert any(f"jumped from 101 to {absurd}" in n for n in notices)


def test_real_publisher_restart_on_the_same_port(make_pub: PublisherFactory) -> None:
    old = make_pub(replay_endpoint=None)
    notices: list[str] = []
    with KVEventSubscriber(old.endpoint, None, TOPIC, on_notice=notices.append) as sub:
        wait_subscribed(old, lambda t: bool(sub.recv(t)))
        # Far ahead, so the new incarnation's seqs stay below it while the
        # subscriber reconnects.
        for _ in range(1000):
            old.publish([AllBlocksCleared()])
        last = old.next_seq - 1
        assert old.flush()
        _collect_until(sub, last)
        old.shutdown()
        new = ZmqEventPublisher(old.endpoint, None, TOPIC)
        try:
            got: list[ReceivedBatch] = []
            for _ in range(int(GUARD_S / 0.05)):
                new.publish([AllBlocksCleared()])
                got.extend(sub.recv(0.05))
                if got:
                    break
                # The old publisher had no replay, so nothing it sent can
                # have a live copy: a duplicate is a restart gone unnoticed.
                assert sub.stats.duplicates == 0, "the restarted publisher's batches were skipped"
        finally:
            new.shutdown()
    assert got, "no batch from the restarted publisher"
    assert got[0].epoch == 1
    assert got[0].seq < last
    assert sub.stats.resyncs == 1
    assert any("went back" in n for n in notices)


# -- replay: bounded, backing off, never past the caller's deadline ------------------


def test_open_replay_never_holds_recv_past_its_deadline() -> None:
    fake = FakePublisher(None)  # a replay socket that never answers
    results: list[list[ReceivedBatch]] = []
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, replay_timeout_s=3600.0
        ) as sub:
            fake.wait_subscriber()
            fake.send(0, _payload(0))
            results.append(_collect_until(sub, 0))
            fake.send(5, _payload(5))  # a gap: the replay stays open for an hour

            def poll_briefly() -> None:
                for _ in range(5):
                    results.append(sub.recv(0.02))

            worker = threading.Thread(target=poll_briefly)
            worker.start()
            worker.join(GUARD_S)
            assert not worker.is_alive(), "recv() waited on the replay past its deadline"
    finally:
        fake.close()
    assert [r.seq for r in results[0]] == [0]
    assert results[1:] == [[]] * 5  # seq 5 is held until the replay ends
    assert fake.requests == [1]
    assert sub.stats.replay_timeouts == 0


def test_replay_timeout_backs_off_and_later_gaps_are_lost_at_once() -> None:
    fake = FakePublisher(None)
    notices: list[str] = []
    try:
        with KVEventSubscriber(
            fake.endpoint,
            fake.replay_endpoint,
            TOPIC,
            replay_timeout_s=0.1,
            replay_backoff_s=3600.0,
            on_notice=notices.append,
        ) as sub:
            fake.wait_subscriber()
            for s in (0, 3):
                fake.send(s, _payload(s))
            got = _collect_until(sub, 3)
            for s in (6, 9):
                fake.send(s, _payload(s))
            got += _collect_until(sub, 9)
    finally:
        fake.close()
    assert [r.seq for r in got] == [0, 3, 6, 9]
    assert sub.lost_ranges == [(1, 2), (4, 5), (7, 8)]
    assert fake.requests == [1]  # no second replay while backing off
    assert sub.stats.replay_timeouts == 1
    assert sub.stats.replays_skipped == 2
    assert any("timed out" in n and "paused for 3600 s" in n for n in notices)


@pytest.mark.parametrize("framing", ["vllm", "legacy"])
@pytest.mark.parametrize("profile", PROFILES)
def test_gap_fill_reads_either_replay_framing_and_payload_profile(
    framing: str, profile: str
) -> None:
    fake = FakePublisher([(s, _payload(s, profile)) for s in range(6)], framing=framing)
    try:
        with KVEventSubscriber(fake.endpoint, fake.replay_endpoint, TOPIC) as sub:
            fake.wait_subscriber()
            for s in (0, 1, 4):
                fake.send(s, _payload(s, profile))
            got = _collect_until(sub, 5)
    finally:
        fake.close()
    assert [(r.seq, r.replayed) for r in got] == [
        (0, False),
        (1, False),
        (2, True),
        (3, True),
        (4, False),
        (5, True),
    ]
    assert {r.profile for r in got} == {profile}
    assert sub.stats.malformed == 0


# -- tier media through the subscriber, both profiles ---------------------------------

H = [bytes([i]) * 32 for i in range(1, 5)]
EXPECTED_WIRE_MEDIUM = {
    "vllm": {
        MEDIUM_GPU: (MEDIUM_GPU, None),
        MEDIUM_CPU: (MEDIUM_CPU, None),
        MEDIUM_DISK: (MEDIUM_STORAGE, LOCALITY_LOCAL),
        MEDIUM_REMOTE: (MEDIUM_STORAGE, LOCALITY_REMOTE),
    },
    "legacy": {m: (m, None) for m in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)},
}


@pytest.mark.parametrize("profile", PROFILES)
def test_every_tier_medium_and_block_size_zero_survive_the_subscriber(
    make_pub: PublisherFactory, profile: str
) -> None:
    pub = make_pub(profile=profile)
    secondary = (MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)
    events = [BlockStored(H, None, list(range(64)), 16, None, MEDIUM_GPU)]
    events += [BlockStored(H[:2], None, [], 0, None, m) for m in secondary]
    events += [BlockRemoved(H[:1], m) for m in (MEDIUM_GPU, *secondary)]
    events += [AllBlocksCleared()]
    pub.publish(events)
    assert pub.flush(120.0)
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, TOPIC, start_seq=0) as sub:
        (received,) = sub.recv(GUARD_S)
    assert received.profile == profile
    got = received.batch.events
    hashes = H if profile == "legacy" else [vllm_block_hash(h) for h in H]
    stored = [e for e in got if isinstance(e, BlockStored)]
    removed = [e for e in got if isinstance(e, BlockRemoved)]
    assert [kvoffload_medium(e) for e in stored] == [MEDIUM_GPU, *secondary]
    assert [kvoffload_medium(e) for e in removed] == [MEDIUM_GPU, *secondary]
    for event, medium in zip(stored, [MEDIUM_GPU, *secondary], strict=True):
        assert (event.medium, event.locality) == EXPECTED_WIRE_MEDIUM[profile][medium]
    assert stored[0].block_size == 16 and stored[0].block_hashes == hashes
    for event in stored[1:]:
        assert event.block_size == 0
        assert event.token_ids == []
        assert event.parent_block_hash is None
        assert event.block_hashes == hashes[:2]
    assert isinstance(got[-1], AllBlocksCleared)


def test_bare_publisher_without_subscribers_answers_replays_in_turn(
    make_pub: PublisherFactory,
) -> None:
    # Two clients asking at once are both answered completely, with END.
    pub = make_pub(buffer_steps=10)
    for _ in range(10):
        pub.publish([AllBlocksCleared()])
    assert pub.flush(120.0)
    ctx = zmq.Context()
    dealers = [ctx.socket(zmq.DEALER) for _ in range(2)]
    try:
        for d in dealers:
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", (3).to_bytes(8, "big")])
        for d in dealers:
            seqs = []
            while True:
                assert d.poll(int(GUARD_S * 1000))
                _, topic, seq_bytes, _ = d.recv_multipart()
                if seq_bytes == ZmqEventPublisher.END_SEQ:
                    assert topic == b""
                    break
                assert topic == TOPIC.encode()
                seqs.append(int.from_bytes(seq_bytes, "big"))
            assert seqs == list(range(3, 10))
    finally:
        for d in dealers:
            d.close(linger=0)
        ctx.term()


def test_loopback_any_constant_is_bindable() -> None:
    pub = ZmqEventPublisher(LOOPBACK_ANY, LOOPBACK_ANY, TOPIC, profile="legacy")
    try:
        assert pub.profile == "legacy"
    finally:
        pub.shutdown()
