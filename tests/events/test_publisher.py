"""ZmqEventPublisher lifecycle and the null publisher."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from kvoffload.events import (
    EventPublisher,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
    make_publisher,
)
from kvoffload.events import publisher as publisher_module
from kvoffload.events.subscriber import KVEventSubscriber
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, encode_batch
from tests.events.conftest import LOOPBACK_ANY, TOPIC, PublisherFactory, wait_subscribed


def _sub(endpoint: str, ctx: zmq.Context) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    return sub


def _poller(sub: zmq.Socket):
    def received_any(timeout_s: float) -> bool:
        if sub.poll(int(timeout_s * 1000)):
            sub.recv_multipart()
            return True
        return False

    return received_any


def test_null_publisher_accepts_and_discards() -> None:
    pub = make_publisher(None)
    assert isinstance(pub, NullEventPublisher)
    assert isinstance(pub, EventPublisher)
    assert pub.publish([AllBlocksCleared()])
    assert pub.publish(KVEventBatch(ts=0.0, events=[]))
    pub.shutdown()
    pub.shutdown()


def test_make_publisher_builds_zmq_publisher() -> None:
    with make_publisher(LOOPBACK_ANY, None, TOPIC, buffer_steps=3, hwm=10) as pub:
        assert isinstance(pub, ZmqEventPublisher)
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        assert not pub.endpoint.endswith(":*")
        assert pub.replay_endpoint is None
        assert pub.publish([AllBlocksCleared()])


def test_shutdown_flushes_everything_accepted(make_pub: PublisherFactory) -> None:
    pub = make_pub(linger_s=5.0)
    ctx = zmq.Context()
    sub = _sub(pub.endpoint, ctx)
    try:
        wait_subscribed(pub, _poller(sub))
        first = pub.next_seq
        for i in range(500):
            pub.publish([BlockRemoved([i.to_bytes(8, "big")], "CPU")])
        pub.shutdown()  # no flush() before: shutdown itself must send them all
        assert not pub.publish([AllBlocksCleared()])
        seqs = []
        while sub.poll(2000):
            _, seq_bytes, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq_bytes, "big"))
            if len(seqs) == 500:
                break
        assert seqs == list(range(first, first + 500))
        assert msgpack.unpackb(payload)[1] == [
            {"type": "BlockRemoved", "block_hashes": [499], "medium": "CPU", "group_idx": 0}
        ]
    finally:
        sub.close(linger=0)
        ctx.term()
    assert pub.stats.published_batches == first + 500
    pub.shutdown()  # idempotent


def test_shutdown_with_nothing_published_and_no_peers_returns() -> None:
    pub = ZmqEventPublisher(LOOPBACK_ANY, LOOPBACK_ANY, TOPIC)
    pub.shutdown()
    assert not pub._thread.is_alive()


def test_publish_never_blocks_without_subscribers_or_at_hwm(make_pub: PublisherFactory) -> None:
    # A subscriber that never reads, and a tiny HWM: PUB drops, publish() still
    # returns at once (nothing here could wait on the socket).
    pub = make_pub(hwm=1, buffer_steps=10)
    ctx = zmq.Context()
    sub = _sub(pub.endpoint, ctx)
    sub.setsockopt(zmq.RCVHWM, 1)
    try:
        events = [BlockRemoved([bytes(32)] * 64, "CPU")] * 50
        assert all(pub.publish(events) for _ in range(2000))
        assert pub.flush(120.0)
        assert pub.stats.published_batches == 2000
        assert pub.next_seq == 2000
    finally:
        sub.close(linger=0)
        ctx.term()


def test_full_queue_drops_and_the_gap_is_reported_lost(
    make_pub: PublisherFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = make_pub(max_queue_size=2)
    # Hold the socket thread inside the encoder so that the queue fills.
    release = threading.Event()
    stalled = threading.Event()

    def slow_encode(batch: KVEventBatch, *args: object, **kwargs: object) -> bytes:
        stalled.set()
        assert release.wait(10)
        return encode_batch(batch, *args, **kwargs)  # type: ignore[arg-type]

    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, TOPIC, start_seq=0) as sub:
        monkeypatch.setattr(publisher_module, "encode_batch", slow_encode)
        assert pub.publish([AllBlocksCleared()])  # seq 0: taken by the thread
        assert stalled.wait(10)
        assert pub.publish([AllBlocksCleared()])  # seq 1, 2: queued
        assert pub.publish([AllBlocksCleared()])
        assert not pub.publish([AllBlocksCleared()])  # seq 3, 4: dropped
        assert not pub.publish([AllBlocksCleared()])
        release.set()
        assert pub.flush(120.0)
        assert pub.publish([AllBlocksCleared()])  # seq 5
        assert pub.flush(120.0)
        seqs: list[int] = []
        while 5 not in seqs:
            got = sub.recv(5.0)
            assert got, "no batch arrived"
            seqs.extend(r.seq for r in got)
    assert pub.stats.dropped_batches == 2
    assert pub.stats.published_batches == 4
    assert pub.next_seq == 6
    # A dropped batch consumed its seq, so subscribers see an unreplayable gap.
    assert seqs == [0, 1, 2, 5]
    assert sub.lost_ranges == [(3, 4)]


def test_ready_batch_is_sent_as_is(make_pub: PublisherFactory) -> None:
    pub = make_pub(data_parallel_rank=1)
    ctx = zmq.Context()
    sub = _sub(pub.endpoint, ctx)
    try:
        wait_subscribed(pub, _poller(sub))
        pub.publish(KVEventBatch(ts=12.5, events=[AllBlocksCleared()], data_parallel_rank=4))
        assert sub.poll(5000)
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        ctx.term()
    assert msgpack.unpackb(payload) == [12.5, [{"type": "AllBlocksCleared"}], 4]


def test_bind_conflict_is_an_oserror(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    with pytest.raises(OSError, match="cannot bind"):
        ZmqEventPublisher(pub.endpoint, None, TOPIC)
    with pytest.raises(OSError, match="cannot bind"):
        ZmqEventPublisher(LOOPBACK_ANY, pub.endpoint, TOPIC)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ZmqEventPublisher("", None)
    with pytest.raises(ValueError):
        ZmqEventPublisher(LOOPBACK_ANY, None, buffer_steps=-1)


def test_publish_from_several_threads_keeps_seqs_unique(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=1000)

    def worker() -> None:
        for _ in range(200):
            pub.publish([AllBlocksCleared()])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pub.flush(120.0)
    assert pub.buffered_seqs() == list(range(800))
