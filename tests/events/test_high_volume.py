"""High volume: 10,000 batches of 100 events through a real PUB/SUB on loopback.

Every batch must reach the consumer intact, live (in order) or through replay.
How many arrive live, and how fast, depends on the machine's load, so it is
not asserted here: ``kvoffload bench events`` measures and prints it. The
consumer is plain pyzmq, as a router would be.
"""

from __future__ import annotations

import itertools
import threading

import msgpack
import zmq

from kvoffload.events.types import BlockRemoved, BlockStored, decode_batch
from tests.events.conftest import TOPIC, PublisherFactory, wait_subscribed

N_BATCHES = 10_000
EVENTS_PER_BATCH = 100
# Only a hang guard: whatever has not arrived live by then is replayed.
HANG_GUARD_S = 120.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _shared_events() -> list[BlockStored]:
    parent = b"\x01" * 32
    return [
        BlockStored([i.to_bytes(32, "big")], parent, list(range(16)), 16, None, "GPU")
        for i in range(EVENTS_PER_BATCH - 1)
    ]


def _receive(
    sub: zmq.Socket, first: int, out: list[tuple[int, bytes]], stop: threading.Event
) -> None:
    """Collect live batches until the last one arrived or ``stop`` is set."""
    last = first + N_BATCHES - 1
    while not stop.is_set():
        if not sub.poll(50):
            continue
        while True:
            try:
                _, seq_bytes, payload = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= first:
                out.append((seq, payload))
            if seq == last:
                return


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> dict[int, bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: dict[int, bytes] = {}
    try:
        while True:
            assert dealer.poll(int(HANG_GUARD_S * 1000)), "replay stalled"
            # vLLM 0.33's replay framing: [b"", topic, seq, payload].
            _, _, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == END_SEQ:
                return got
            got[int.from_bytes(seq_bytes, "big")] = payload
    finally:
        dealer.close(linger=0)


def test_10k_batches_of_100_events(make_pub: PublisherFactory) -> None:
    # The replay buffer holds the whole run, so whatever is missed live is
    # replayable; the HWMs let a burst queue instead of dropping.
    pub = make_pub(buffer_steps=N_BATCHES + 100, hwm=N_BATCHES + 100)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, N_BATCHES + 100)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(pub.endpoint)

    def received_any(timeout_s: float) -> bool:
        if sub.poll(int(timeout_s * 1000)):
            sub.recv_multipart()
            return True
        return False

    try:
        wait_subscribed(pub, received_any)
        first = pub.next_seq
        shared = _shared_events()
        received: list[tuple[int, bytes]] = []
        stop = threading.Event()
        receiver = threading.Thread(target=_receive, args=(sub, first, received, stop))
        receiver.start()
        for i in range(N_BATCHES):
            # The last event is unique per batch, to check payloads against seqs.
            assert pub.publish([*shared, BlockRemoved([i.to_bytes(8, "big")], "GPU")])
        assert pub.flush(HANG_GUARD_S)
        receiver.join(HANG_GUARD_S)
        stop.set()
        receiver.join()

        seqs = [s for s, _ in received]
        assert all(a < b for a, b in itertools.pairwise(seqs)), "live batches out of order"
        assert set(seqs) <= set(range(first, first + N_BATCHES))
        missing = sorted(set(range(first, first + N_BATCHES)) - set(seqs))
        if missing:
            replayed = _replay(ctx, pub.replay_endpoint, missing[0])
            assert set(missing) <= set(replayed)
            received.extend((s, replayed[s]) for s in missing)
        # Always prove the tail is replayable too, even when nothing was missed.
        tail = _replay(ctx, pub.replay_endpoint, first + N_BATCHES - 10)
        assert sorted(tail) == list(range(first + N_BATCHES - 10, first + N_BATCHES))
    finally:
        sub.close(linger=0)
        ctx.term()

    by_seq = dict(received)
    assert sorted(by_seq) == list(range(first, first + N_BATCHES))
    for seq in (first, first + N_BATCHES // 2, first + N_BATCHES - 1):
        _, events, _ = msgpack.unpackb(by_seq[seq])
        assert len(events) == EVENTS_PER_BATCH
        assert events[-1] == {
            "type": "BlockRemoved",
            "block_hashes": [seq - first],
            "medium": "GPU",
            "group_idx": 0,
        }
        assert events[0]["type"] == "BlockStored"
    for seq, payload in by_seq.items():
        batch = decode_batch(payload)
        assert len(batch.events) == EVENTS_PER_BATCH
        assert batch.events[-1].block_hashes == [seq - first]
