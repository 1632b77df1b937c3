"""The wire format as an outside consumer sees it: plain pyzmq + msgpack, no kvoffload.

The consumer below is written the way a router (llm-d, Dynamo, vLLM's example
subscriber) reads vLLM's stream: three frames, seq as 8 big-endian bytes,
msgpack ``[ts, events, data_parallel_rank]`` with each event an array
``[tag, field0, field1, ...]`` in vLLM's field order.
"""

from __future__ import annotations

import time

import msgpack
import zmq

from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from tests.events.conftest import TOPIC, PublisherFactory, wait_subscribed

H1 = bytes(range(32))
H2 = bytes(range(32, 64))
PARENT = b"\xff" * 32


class PlainConsumer:
    """A subscriber that knows only the documented protocol."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def poll_one(self, timeout_s: float) -> tuple[bytes, int, list] | None:
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq_bytes, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq_bytes, "big"), msgpack.unpackb(payload)

    def any(self, timeout_s: float) -> bool:
        return self.poll_one(timeout_s) is not None

    def replay_dealer(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Replay with a DEALER sending REQ's envelope, as llm-d does."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == self.END_SEQ:
                assert payload == b""
                break
            out.append((int.from_bytes(seq_bytes, "big"), payload))
        dealer.close(linger=0)
        return out

    def replay_req_first(self, start_seq: int) -> tuple[bytes, bytes]:
        """A REQ client (vLLM's example subscriber) gets the first reply frame pair."""
        assert self.replay_endpoint is not None
        req = self.ctx.socket(zmq.REQ)
        req.connect(self.replay_endpoint)
        req.send(start_seq.to_bytes(8, "big"))
        assert req.poll(5000)
        seq_bytes, payload = req.recv_multipart()
        req.close(linger=0)
        return seq_bytes, payload

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def _subscribed(pub: ZmqEventPublisher, topic: bytes = TOPIC.encode()) -> PlainConsumer:
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, topic)
    wait_subscribed(pub, consumer.any)
    return consumer


def test_fields_decode_in_vllm_order(make_pub: PublisherFactory) -> None:
    pub = make_pub(data_parallel_rank=3)
    consumer = _subscribed(pub)
    try:
        seq0 = pub.next_seq
        before = time.time()
        assert pub.publish(
            [
                BlockStored([H1, H2], PARENT, list(range(32)), 16, None, "GPU"),
                BlockStored([H2], None, [], 0, 7, "CPU", "adapter-a"),
                BlockRemoved([H1], "CPU"),
                BlockRemoved([H2]),
                AllBlocksCleared(),
            ]
        )
        got = consumer.poll_one(5.0)
        assert got is not None
        topic, seq, batch = got
    finally:
        consumer.close()
    assert topic == b"kv-events"
    assert seq == seq0
    ts, events, dp_rank = batch
    assert before <= ts <= time.time()
    assert dp_rank == 3
    assert events == [
        # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
        ["BlockStored", [H1, H2], PARENT, list(range(32)), 16, None, "GPU", None],
        ["BlockStored", [H2], None, [], 0, 7, "CPU", "adapter-a"],
        # tag, block_hashes, medium
        ["BlockRemoved", [H1], "CPU"],
        ["BlockRemoved", [H2], None],
        ["AllBlocksCleared"],
    ]


def test_int_hashes_and_no_rank(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    consumer = _subscribed(pub)
    try:
        pub.publish([BlockStored([2**63 + 5], 17, [1], 1, None, "GPU")])
        got = consumer.poll_one(5.0)
    finally:
        consumer.close()
    assert got is not None
    _, _, (_, events, dp_rank) = got
    assert dp_rank is None
    assert events == [["BlockStored", [2**63 + 5], 17, [1], 1, None, "GPU", None]]


def test_seq_frame_is_8_byte_big_endian_and_increments(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    consumer = _subscribed(pub)
    raw: list[bytes] = []
    try:
        first = pub.next_seq
        for _ in range(3):
            pub.publish([AllBlocksCleared()])
        for _ in range(3):
            assert consumer.sub.poll(5000)
            raw.append(consumer.sub.recv_multipart()[1])
    finally:
        consumer.close()
    assert raw == [(first + i).to_bytes(8, "big") for i in range(3)]


def test_topic_filter(make_pub: PublisherFactory) -> None:
    pub = make_pub(topic="kv-events")
    other = PlainConsumer(pub.endpoint, None, b"something-else")
    consumer = _subscribed(pub)
    try:
        pub.publish([AllBlocksCleared()])
        assert consumer.any(5.0)
        assert not other.any(0.2)
    finally:
        consumer.close()
        other.close()


def test_replay_from_seq_dealer(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=100)
    for i in range(10):
        pub.publish([BlockRemoved([i.to_bytes(32, "big")], "CPU")])
    assert pub.flush()
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        replayed = consumer.replay_dealer(4)
        everything = consumer.replay_dealer(0)
        beyond = consumer.replay_dealer(10)
    finally:
        consumer.close()
    assert [s for s, _ in replayed] == list(range(4, 10))
    for seq, payload in replayed:
        _, events, _ = msgpack.unpackb(payload)
        assert events == [["BlockRemoved", [seq.to_bytes(32, "big")], "CPU"]]
    assert [s for s, _ in everything] == list(range(10))
    assert beyond == []


def test_replay_req_client_gets_vllm_frames(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    pub.publish([AllBlocksCleared()])
    pub.publish([BlockRemoved([H1], "GPU")])
    assert pub.flush()
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        seq_bytes, payload = consumer.replay_req_first(1)
        end_bytes, end_payload = consumer.replay_req_first(99)
    finally:
        consumer.close()
    assert seq_bytes == (1).to_bytes(8, "big")
    assert msgpack.unpackb(payload)[1] == [["BlockRemoved", [H1], "GPU"]]
    # Nothing from 99 on: just the end marker, seq -1 and an empty payload.
    assert end_bytes == PlainConsumer.END_SEQ
    assert end_payload == b""


def test_replay_buffer_keeps_only_the_last_buffer_steps(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=5)
    for _ in range(12):
        pub.publish([AllBlocksCleared()])
    assert pub.flush()
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        replayed = consumer.replay_dealer(0)
    finally:
        consumer.close()
    assert [s for s, _ in replayed] == list(range(7, 12))


def test_malformed_replay_request_still_gets_end_marker(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"abc"])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", PlainConsumer.END_SEQ, b""]
        # A bare DEALER request (no empty delimiter) is answered without one.
        pub.publish([AllBlocksCleared()])
        assert pub.flush()
        dealer.send((0).to_bytes(8, "big"))
        assert dealer.poll(5000)
        seq_bytes, payload = dealer.recv_multipart()
        assert int.from_bytes(seq_bytes, "big") == 0
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
        assert dealer.recv_multipart() == [PlainConsumer.END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        ctx.term()
