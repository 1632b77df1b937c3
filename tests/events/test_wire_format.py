"""The wire format as an outside consumer sees it: plain pyzmq + msgpack, no kvoffload.

The consumer below is written the way a router reads the stream: three
frames, seq as 8 big-endian bytes, msgpack ``[ts, events,
data_parallel_rank]``. In the default "vllm" profile each event is a map tagged
"type" (vLLM 0.33's layout, integer hashes); in the "legacy" profile an array
``[tag, field0, field1, ...]`` with hashes as bytes (kvoffload's earlier layout,
which llm-d's adapter parses).
"""

from __future__ import annotations

import time

import msgpack
import zmq

from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
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

    def replay_dealer(self, start_seq: int, topic: bytes | None = None) -> list[tuple[int, bytes]]:
        """Replay with a DEALER sending REQ's envelope, as llm-d does.

        ``topic`` given: vLLM's framing ``[b"", topic, seq, payload]``, ended by
        ``[b"", b"", END_SEQ, b""]``; None: the legacy ``[b"", seq, payload]``.
        """
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if topic is None:
                _, seq_bytes, payload = frames
            else:
                _, got_topic, seq_bytes, payload = frames
                assert got_topic == (b"" if seq_bytes == self.END_SEQ else topic)
            if seq_bytes == self.END_SEQ:
                assert payload == b""
                break
            out.append((int.from_bytes(seq_bytes, "big"), payload))
        dealer.close(linger=0)
        return out

    def replay_req_first(self, start_seq: int) -> list[bytes]:
        """A REQ client (vLLM's example subscriber) gets the first reply's frames."""
        assert self.replay_endpoint is not None
        req = self.ctx.socket(zmq.REQ)
        req.connect(self.replay_endpoint)
        req.send(start_seq.to_bytes(8, "big"))
        assert req.poll(5000)
        frames = req.recv_multipart()
        req.close(linger=0)
        return frames

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def _subscribed(pub: ZmqEventPublisher, topic: bytes = TOPIC.encode()) -> PlainConsumer:
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, topic)
    wait_subscribed(pub, consumer.any)
    return consumer


def test_legacy_fields_decode_in_positional_order(make_pub: PublisherFactory) -> None:
    pub = make_pub(data_parallel_rank=3, profile="legacy")
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


def test_legacy_int_hashes_and_no_rank(make_pub: PublisherFactory) -> None:
    pub = make_pub(profile="legacy")
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


def test_legacy_replay_from_seq_dealer(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=100, profile="legacy")
    for i in range(10):
        pub.publish([BlockRemoved([i.to_bytes(32, "big")], "CPU")])
    assert pub.flush(120.0)
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
    assert pub.flush(120.0)
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        first = consumer.replay_req_first(1)
        end = consumer.replay_req_first(99)
    finally:
        consumer.close()
    assert first[:2] == [TOPIC.encode(), (1).to_bytes(8, "big")]
    assert msgpack.unpackb(first[2])[1] == [
        {"type": "BlockRemoved", "block_hashes": [_int(H1)], "medium": "GPU", "group_idx": 0}
    ]
    # Nothing from 99 on: just the end marker, an empty topic, seq -1, no payload.
    assert end == [b"", PlainConsumer.END_SEQ, b""]


def test_legacy_replay_req_client_frames(make_pub: PublisherFactory) -> None:
    pub = make_pub(profile="legacy")
    pub.publish([BlockRemoved([H1], "GPU")])
    assert pub.flush(120.0)
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        seq_bytes, payload = consumer.replay_req_first(0)
        end = consumer.replay_req_first(99)
    finally:
        consumer.close()
    assert seq_bytes == (0).to_bytes(8, "big")
    assert msgpack.unpackb(payload)[1] == [["BlockRemoved", [H1], "GPU"]]
    assert end == [PlainConsumer.END_SEQ, b""]


def test_vllm_replay_from_seq_dealer(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=100)
    for i in range(10):
        pub.publish([BlockRemoved([i.to_bytes(32, "big")], "CPU")])
    assert pub.flush(120.0)
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        replayed = consumer.replay_dealer(4, TOPIC.encode())
        beyond = consumer.replay_dealer(10, TOPIC.encode())
    finally:
        consumer.close()
    assert [s for s, _ in replayed] == list(range(4, 10))
    for seq, payload in replayed:
        _, events, rank = msgpack.unpackb(payload)
        assert rank == 0
        assert events == [
            {"type": "BlockRemoved", "block_hashes": [seq], "medium": "CPU", "group_idx": 0}
        ]
    assert beyond == []


def test_replay_buffer_keeps_only_the_last_buffer_steps(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=5)
    for _ in range(12):
        pub.publish([AllBlocksCleared()])
    assert pub.flush(120.0)
    consumer = PlainConsumer(pub.endpoint, pub.replay_endpoint, b"")
    try:
        replayed = consumer.replay_dealer(0, TOPIC.encode())
    finally:
        consumer.close()
    assert [s for s, _ in replayed] == list(range(7, 12))


def test_malformed_replay_request_still_gets_end_marker(make_pub: PublisherFactory) -> None:
    pub = make_pub(profile="legacy")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"abc"])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", PlainConsumer.END_SEQ, b""]
        # A bare DEALER request (no empty delimiter) is answered without one.
        pub.publish([AllBlocksCleared()])
        assert pub.flush(120.0)
        dealer.send((0).to_bytes(8, "big"))
        assert dealer.poll(5000)
        seq_bytes, payload = dealer.recv_multipart()
        assert int.from_bytes(seq_bytes, "big") == 0
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
        assert dealer.recv_multipart() == [PlainConsumer.END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        ctx.term()


def _int(h: bytes) -> int:
    """vLLM 0.33's integer form of a hash: the low 64 bits, big-endian."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def test_vllm_profile_tagged_maps_every_field_int_hashes(make_pub: PublisherFactory) -> None:
    pub = make_pub(data_parallel_rank=3)
    consumer = _subscribed(pub)
    try:
        seq0 = pub.next_seq
        assert pub.publish(
            [
                BlockStored([H1, H2], PARENT, list(range(32)), 16, None, "GPU"),
                BlockStored([H2], None, [], 0, 7, "CPU", "adapter-a"),
                BlockStored([H1], None, [], 0, None, "DISK"),
                BlockRemoved([H1], "REMOTE"),
                BlockRemoved([H2]),
                AllBlocksCleared(),
            ]
        )
        got = consumer.poll_one(5.0)
        assert got is not None
        topic, seq, batch = got
    finally:
        consumer.close()
    assert (topic, seq) == (b"kv-events", seq0)
    _, events, dp_rank = batch
    assert dp_rank == 3
    stored = {"type": "BlockStored", "parent_block_hash": None, "token_ids": [], "block_size": 0}
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [_int(H1), _int(H2)],
            "parent_block_hash": _int(PARENT),
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        },
        {
            **stored,
            "block_hashes": [_int(H2)],
            "lora_id": 7,
            "medium": "CPU",
            "lora_name": "adapter-a",
            "group_idx": 0,
        },
        {
            **stored,
            "block_hashes": [_int(H1)],
            "lora_id": None,
            "medium": "STORAGE",
            "lora_name": None,
            "group_idx": 0,
            "locality": "LOCAL",
        },
        {
            "type": "BlockRemoved",
            "block_hashes": [_int(H1)],
            "medium": "STORAGE",
            "group_idx": 0,
            "locality": "REMOTE",
        },
        {"type": "BlockRemoved", "block_hashes": [_int(H2)], "medium": None, "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]


def test_vllm_profile_rank_defaults_to_zero_and_env_turns_off_int_hashes(
    monkeypatch,
) -> None:
    batch = KVEventBatch(ts=1.0, events=[BlockRemoved([H1], "GPU")])
    assert msgpack.unpackb(encode_batch(batch)) == [
        1.0,
        [{"type": "BlockRemoved", "block_hashes": [_int(H1)], "medium": "GPU", "group_idx": 0}],
        0,
    ]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert msgpack.unpackb(encode_batch(batch))[1][0]["block_hashes"] == [H1]
    assert msgpack.unpackb(encode_batch(batch, int_hashes=True))[1][0]["block_hashes"] == [_int(H1)]


def test_bad_profile_is_a_value_error() -> None:
    import pytest

    from kvoffload.events import make_publisher

    with pytest.raises(ValueError, match="unknown KV events format 'json'"):
        make_publisher(None, events_format="json")
    with pytest.raises(ValueError, match="unknown KV events format"):
        encode_batch(KVEventBatch(ts=0.0, events=[]), "v1")
