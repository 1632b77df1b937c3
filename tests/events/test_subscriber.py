"""KVEventSubscriber: catch-up from a seq, gap detection, replay fill, losses."""

from __future__ import annotations

import threading

from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.events.subscriber import GapReport, KVEventSubscriber, ReceivedBatch, connectable
from kvoffload.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    vllm_block_hash,
)
from tests.events.conftest import TOPIC, FakePublisher, PublisherFactory, wait_subscribed

_PAD = "x" * 30_000


def _big_batch(i: int) -> list[BlockStored]:
    # ~30 KB encoded (cheaply: one long string), so a few hundred batches
    # overflow ZMQ's and the kernel's buffers between a PUB and a SUB that is
    # not reading.
    return [BlockStored([i.to_bytes(32, "big")], None, [], 16, None, "GPU", _PAD)]


def _collect(sub: KVEventSubscriber, until_seq: int, timeout_s: float = 5.0) -> list[ReceivedBatch]:
    out: list[ReceivedBatch] = []
    while not out or out[-1].seq < until_seq:
        got = sub.recv(timeout_s)
        assert got, f"stalled after {[r.seq for r in out[-3:]]}"
        out.extend(got)
    return out


def _received_any(sub: KVEventSubscriber):
    return lambda timeout_s: bool(sub.recv(timeout_s))


def test_start_seq_catches_up_then_follows_live(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    for i in range(5):
        pub.publish([BlockRemoved([bytes([i]) * 32], "GPU")])
    assert pub.flush(120.0)
    seen: list[ReceivedBatch] = []

    def received_any(timeout_s: float) -> bool:
        got = sub.recv(timeout_s)
        seen.extend(got)
        return bool(got)

    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, TOPIC, start_seq=0) as sub:
        first = sub.recv(5.0)
        assert [(r.seq, r.replayed) for r in first] == [(i, True) for i in range(5)]
        assert first[3].batch.events == [
            BlockRemoved([vllm_block_hash(bytes([3]) * 32)], "GPU", group_idx=0)
        ]
        # Probes published before the subscription took hold are missed live
        # and replayed: either way each seq is handed out once, in order.
        wait_subscribed(pub, received_any)
        start = pub.next_seq
        pub.publish([AllBlocksCleared()])
        live = _collect(sub, start)
    assert [(r.seq, r.replayed) for r in live] == [(start, False)]
    assert live[0].batch.events == [AllBlocksCleared()]
    assert [r.seq for r in first + seen + live] == list(range(start + 1))
    assert sub.lost_ranges == []


def _flood_and_collect(
    pub: ZmqEventPublisher, sub: KVEventSubscriber, n: int
) -> list[ReceivedBatch]:
    """Publish ``n`` big batches while ``sub`` is not reading, then receive.

    The tail of the flood may be dropped with nothing after it to reveal the
    gap, so a marker batch is published once the stream went quiet, and
    collected too (and left out of the result).
    """
    for i in range(n):
        assert pub.publish(_big_batch(i))
    assert pub.flush(120.0)
    got: list[ReceivedBatch] = []
    while batch := sub.recv(0.5):
        got.extend(batch)
    marker = pub.next_seq
    pub.publish([AllBlocksCleared()])
    got.extend(_collect(sub, marker))
    assert got[-1].seq == marker
    return got[:-1]


def test_gap_from_overflow_is_detected_and_replayed(make_pub: PublisherFactory) -> None:
    pub = make_pub(hwm=4, buffer_steps=2000)
    reports: list[GapReport] = []
    with KVEventSubscriber(
        pub.endpoint, pub.replay_endpoint, TOPIC, rcvhwm=4, on_gap=reports.append
    ) as sub:
        wait_subscribed(pub, _received_any(sub))
        start = pub.next_seq
        # Not reading while ~30 MB go out: PUB drops beyond its HWM.
        got = _flood_and_collect(pub, sub, 1000)
    seqs = [r.seq for r in got]
    assert seqs == list(range(start, start + 1000))
    assert sub.stats.gaps >= 1
    assert reports and all(rep.lost == () for rep in reports)
    assert sub.stats.replayed == sum(r.replayed for r in got) > 0
    assert sub.lost_ranges == []
    for r in (got[0], got[-1], *[r for r in got if r.replayed][:3]):
        assert r.batch.events[0].block_hashes == [r.seq - start]


def test_gap_beyond_the_replay_buffer_is_reported_lost(make_pub: PublisherFactory) -> None:
    pub = make_pub(hwm=4, buffer_steps=20)
    reports: list[GapReport] = []
    with KVEventSubscriber(
        pub.endpoint, pub.replay_endpoint, TOPIC, rcvhwm=4, on_gap=reports.append
    ) as sub:
        wait_subscribed(pub, _received_any(sub))
        start = pub.next_seq
        got = _flood_and_collect(pub, sub, 1000)
    seqs = [r.seq for r in got]
    lost = [s for a, b in sub.lost_ranges for s in range(a, b + 1)]
    # Every seq is accounted for exactly once: handed out or reported lost.
    assert sorted(seqs + lost) == list(range(start, start + 1000))
    assert seqs == sorted(set(seqs))
    assert lost
    assert sub.stats.lost_batches == len(lost)
    assert [rng for rep in reports for rng in rep.lost] == sub.lost_ranges


def test_without_replay_endpoint_gaps_are_lost(make_pub: PublisherFactory) -> None:
    pub = make_pub(hwm=4)
    with KVEventSubscriber(pub.endpoint, None, TOPIC, rcvhwm=4) as sub:
        wait_subscribed(pub, _received_any(sub))
        start = pub.next_seq
        got = _flood_and_collect(pub, sub, 1000)
    seqs = [r.seq for r in got]
    lost = [s for a, b in sub.lost_ranges for s in range(a, b + 1)]
    assert sorted(seqs + lost) == list(range(start, start + 1000))
    assert not any(r.replayed for r in got)
    assert sub.stats.gaps >= 1


def _payload(seq: int) -> bytes:
    return encode_batch(
        KVEventBatch(ts=float(seq), events=[BlockRemoved([seq.to_bytes(32, "big")], "CPU")])
    )


def test_gap_fill_takes_newer_replayed_batches_and_skips_live_duplicates() -> None:
    fake = FakePublisher([(s, _payload(s)) for s in range(0, 6)])
    reports: list[GapReport] = []
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, on_gap=reports.append
        ) as sub:
            fake.wait_subscriber()
            for s in (0, 1, 4, 5, 6):
                fake.send(s, _payload(s))
            got = _collect(sub, 6)
    finally:
        fake.close()
    assert [(r.seq, r.replayed) for r in got] == [
        (0, False),
        (1, False),
        (2, True),
        (3, True),
        (4, False),  # the live batch that revealed the gap
        (5, True),  # newer, from the replay: its live copy is a duplicate
        (6, False),
    ]
    assert [r.batch.ts for r in got] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert fake.requests == [2]
    assert reports == [GapReport(first=2, last=3, recovered=2, lost=())]
    assert sub.stats.duplicates == 1


def test_replay_that_never_answers_times_out_and_records_the_loss() -> None:
    fake = FakePublisher(None)
    try:
        with KVEventSubscriber(
            fake.endpoint, fake.replay_endpoint, TOPIC, replay_timeout_s=0.2
        ) as sub:
            fake.wait_subscriber()
            for s in (10, 13, 14):
                fake.send(s, _payload(s))
            got = _collect(sub, 14)
    finally:
        fake.close()
    assert [r.seq for r in got] == [10, 13, 14]
    assert sub.lost_ranges == [(11, 12)]
    assert sub.stats.replay_timeouts == 1


def test_malformed_messages_are_counted_not_fatal() -> None:
    fake = FakePublisher([])
    try:
        with KVEventSubscriber(fake.endpoint, fake.replay_endpoint, TOPIC) as sub:
            fake.wait_subscriber()
            fake.pub.send_multipart([TOPIC.encode(), b"short", b""])
            fake.send(0, b"\xc1 not msgpack")
            fake.send(1, _payload(1))
            got = _collect(sub, 1)
    finally:
        fake.close()
    assert [r.seq for r in got] == [1]
    assert sub.stats.malformed == 2
    assert sub.lost_ranges == [(0, 0)]


def test_connectable_rewrites_bind_wildcards() -> None:
    assert connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://10.0.0.2:5557") == "tcp://10.0.0.2:5557"
    assert connectable("ipc:///tmp/kv") == "ipc:///tmp/kv"


def test_recv_keeps_waiting_after_an_undecodable_batch() -> None:
    # An undecodable batch that arrives alone must not end recv() before its deadline.
    fake = FakePublisher([])
    try:
        with KVEventSubscriber(fake.endpoint, fake.replay_endpoint, TOPIC) as sub:
            fake.wait_subscriber()
            fake.send(0, b"\xc1 not msgpack")
            timer = threading.Timer(0.3, fake.send, (1, _payload(1)))
            timer.start()
            got = sub.recv(5.0)
            timer.join()
    finally:
        fake.close()
    assert [r.seq for r in got] == [1]
    assert sub.lost_ranges == [(0, 0)]


def test_bad_replay_endpoint_is_an_oserror_and_leaks_no_socket() -> None:
    # The DEALER that failed to connect used to stay open, so closing the
    # context blocked for ever. The thread join is only a hang guard.
    errors: list[BaseException] = []

    def build() -> None:
        try:
            KVEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:notaport")
        except OSError as exc:
            errors.append(exc)

    worker = threading.Thread(target=build)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "constructing the subscriber hung"
    assert errors and "notaport" in str(errors[0])


def test_a_restarted_publishers_first_batches_missed_live_come_from_its_replay() -> None:
    """A publisher restarted at a restart-safe seq far ahead: the batches SUB missed while
    joining are taken from its replay buffer, not dropped with the resync."""
    big = 5_000_000_000
    new_stream = [(s, _payload(s)) for s in range(big, big + 4)]
    fake = FakePublisher(new_stream)
    try:
        with KVEventSubscriber(fake.endpoint, fake.replay_endpoint, TOPIC) as sub:
            fake.wait_subscriber()
            fake.send(0, _payload(0))
            fake.send(1, _payload(1))
            first_epoch = _collect(sub, 1)
            # The restarted publisher's big .. big+2 went out before SUB joined it.
            fake.send(big + 3, _payload(big + 3))
            fake.send(big + 4, _payload(big + 4))
            got = _collect(sub, big + 4)
    finally:
        fake.close()
    assert [r.seq for r in first_epoch] == [0, 1]
    assert [(r.seq, r.replayed) for r in got] == [
        (big, True),
        (big + 1, True),
        (big + 2, True),
        (big + 3, False),
        (big + 4, False),
    ]
    assert fake.requests == [2]
    assert sub.lost_ranges == []
    assert sub.stats.resyncs == 1


def test_a_bad_seq_far_ahead_still_resyncs_without_a_huge_loss() -> None:
    fake = FakePublisher([(s, _payload(s)) for s in range(0, 3)])
    bad = (1 << 63) - 5
    try:
        with KVEventSubscriber(fake.endpoint, fake.replay_endpoint, TOPIC) as sub:
            fake.wait_subscriber()
            fake.send(0, _payload(0))
            fake.send(bad, _payload(bad))
            got = _collect(sub, bad)
    finally:
        fake.close()
    assert [r.seq for r in got] == [0, bad]
    assert sub.lost_ranges == []
    assert sub.stats.resyncs == 1
