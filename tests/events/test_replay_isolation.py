"""Live events never wait behind replays (issue 33, fault "live events wait behind replays").

10,000 batches buffered, 200 clients ask the replay socket for everything
from seq 0 and never read: live batches must still flow, and the
publisher must not queue the whole buffer once per client.
"""

from __future__ import annotations

import threading
import time

import zmq

from kvoffload.events import BlockStored
from kvoffload.events.types import decode_batch
from tests.events.conftest import HANG_GUARD_S, PublisherFactory

N_BUFFERED = 10_000
N_CLIENTS = 200
N_LIVE = 100
CLIENT_HWM = 16


def _batch(i: int) -> list[BlockStored]:
    # ~2 KB payloads: big enough that a full buffer per client would be noticed.
    return [BlockStored([i.to_bytes(32, "big")], None, list(range(256)), 256, None, "GPU")]


def _fill(pub_factory: PublisherFactory, **kw: object):  # type: ignore[no-untyped-def]
    pub = pub_factory(buffer_steps=N_BUFFERED, replay_client_hwm=CLIENT_HWM, **kw)
    for i in range(N_BUFFERED):
        assert pub.publish(_batch(i))
    assert pub.flush(120.0)
    return pub


def _flood(ctx: zmq.Context, endpoint: str) -> list[zmq.Socket]:
    clients = []
    for _ in range(N_CLIENTS):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVHWM, 1)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        clients.append(d)
    return clients


def _wait(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    give_up = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < give_up, what
        time.sleep(0.01)


def _live_reach_subscriber(pub, ctx: zmq.Context) -> list[int]:  # type: ignore[no-untyped-def]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    # Beat the slow joiner: probes until one arrives.
    for _ in range(500):
        pub.publish(_batch(-1 & 0xFFFF))
        if sub.poll(20):
            break
    else:
        raise AssertionError("subscriber never joined")
    first_live = pub.next_seq
    for i in range(N_LIVE):
        assert pub.publish(_batch(N_BUFFERED + i))
    seqs: list[int] = []
    give_up = time.monotonic() + HANG_GUARD_S
    while len(seqs) < N_LIVE:
        assert time.monotonic() < give_up, f"live batches stuck: got {len(seqs)}"
        if not sub.poll(100):
            continue
        _, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq >= first_live:
            decode_batch(payload)
            seqs.append(seq)
    sub.close()
    return seqs


def test_live_batches_flow_while_every_replay_is_stuck(make_pub: PublisherFactory) -> None:
    pub = _fill(make_pub)
    # Freeze the replay side outright: whatever it does, it does it apart.
    frozen = threading.Event()
    release = threading.Event()
    replay = pub._replay
    assert replay is not None
    serve = replay._serve_once

    def stuck() -> None:
        frozen.set()
        release.wait(HANG_GUARD_S)
        serve()

    replay._serve_once = stuck  # type: ignore[method-assign]
    ctx = zmq.Context()
    try:
        clients = _flood(ctx, pub.replay_endpoint)
        _wait(frozen.is_set, "replay thread never ran")
        seqs = _live_reach_subscriber(pub, ctx)
        assert seqs == sorted(seqs) and len(set(seqs)) == N_LIVE
    finally:
        release.set()
        for c in clients:
            c.close()
        ctx.term()


def test_live_batches_flow_through_a_real_flood(make_pub: PublisherFactory) -> None:
    pub = _fill(make_pub)
    ctx = zmq.Context()
    clients: list[zmq.Socket] = []
    try:
        clients = _flood(ctx, pub.replay_endpoint)
        _wait(lambda: pub.stats.replay_requests == N_CLIENTS, "requests not taken")
        seqs = _live_reach_subscriber(pub, ctx)
        assert seqs == sorted(seqs) and len(set(seqs)) == N_LIVE
        assert pub.open_replays > 0  # the flood was still being served meanwhile
    finally:
        for c in clients:
            c.close()
        ctx.term()


def test_clients_that_never_read_are_bounded_then_abandoned(make_pub: PublisherFactory) -> None:
    # 64 KiB batches fill a non-reading client's pipe and socket buffers quickly.
    n_batches, n_clients = 400, 20
    pub = make_pub(buffer_steps=n_batches, replay_client_hwm=CLIENT_HWM, replay_stall_s=0.3)
    big = [BlockStored([b"\x01" * 32], None, list(range(16)) * 1024, 16384, None, "GPU")]
    for _ in range(n_batches):
        assert pub.publish(big)
    assert pub.flush(120.0)
    ctx = zmq.Context()
    clients: list[zmq.Socket] = []
    try:
        for _ in range(n_clients):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 1 << 16)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            clients.append(d)
        _wait(lambda: pub.stats.replay_requests == n_clients, "requests not taken")
        _wait(lambda: pub.open_replays == 0, "stalled replays never abandoned")
        stats = pub.stats.replay
        # Every job parked at its client's bound and was given up, having sent
        # part of the buffer: not a full copy of it queued per client.
        assert stats.abandoned == n_clients
        assert stats.replayed_batches < n_clients * n_batches
    finally:
        for c in clients:
            c.close()
        ctx.term()


def test_a_slow_reader_still_gets_the_whole_replay(make_pub: PublisherFactory) -> None:
    # A full pipe parks the job (ROUTER_MANDATORY): no silent drop of its tail.
    pub = _fill(make_pub)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVHWM, 1)
    try:
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", (N_BUFFERED - 3000).to_bytes(8, "big")])
        _wait(lambda: pub.stats.replay.parked >= 1, "the pipe never filled")
        seqs = []
        while True:
            assert d.poll(int(HANG_GUARD_S * 1000)), "replay stalled"
            _, _, seq_bytes, _ = d.recv_multipart()
            if seq_bytes == pub.END_SEQ:
                break
            seqs.append(int.from_bytes(seq_bytes, "big"))
        assert seqs == list(range(N_BUFFERED - 3000, N_BUFFERED))
    finally:
        d.close(linger=0)
        ctx.term()
