"""Fixtures for the KV events tests: publishers on loopback with OS-chosen ports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from kvoffload.events.publisher import END_SEQ, ZmqEventPublisher
from kvoffload.events.subscriber import KVEventSubscriber, ReceivedBatch
from kvoffload.events.types import AllBlocksCleared

TOPIC = "kv-events"
LOOPBACK_ANY = "tcp://127.0.0.1:*"

PublisherFactory = Callable[..., ZmqEventPublisher]

#: Only a hang guard for a scripted peer whose batches never come.
HANG_GUARD_S = 30.0


def live_taken_in(sub: KVEventSubscriber) -> int:
    """Live batches ``sub`` has dealt with: handed out live, or skipped as duplicates.

    A live batch that waits behind an open replay is not counted yet, so once
    this equals the number of well-formed live batches sent, nothing more can
    come out of ``sub``.
    """
    stats = sub.stats
    return stats.received - stats.replayed + stats.duplicates


def collect_until(
    sub: KVEventSubscriber,
    done: Callable[[list[ReceivedBatch]], bool],
    live_sent: int,
    guard_s: float = HANG_GUARD_S,
) -> list[ReceivedBatch]:
    """Receive from ``sub`` until ``done(received)``; fail at once on a stall.

    ``live_sent`` is how many well-formed live batches the scripted publisher
    sent. When the subscriber has taken in all of them and ``done`` is still
    false, nothing will ever make it true (e.g. a restart taken for duplicates),
    so this fails then instead of waiting out a receive deadline; ``guard_s``
    only bounds waiting for batches still on their way.
    """
    out: list[ReceivedBatch] = []
    give_up = time.monotonic() + guard_s
    while not done(out):
        got = sub.recv(0.2)
        out.extend(got)
        if got:
            continue
        where = f"{[(r.epoch, r.seq, r.replayed) for r in out]} {sub.stats}"
        assert live_taken_in(sub) < live_sent, f"stalled with every live batch taken in: {where}"
        assert time.monotonic() < give_up, f"stalled: {where}"
    return out


@pytest.fixture
def make_pub() -> Iterator[PublisherFactory]:
    """Build publishers bound to free loopback ports; all shut down at teardown."""
    made: list[ZmqEventPublisher] = []

    def factory(**kwargs: Any) -> ZmqEventPublisher:
        kwargs.setdefault("endpoint", LOOPBACK_ANY)
        kwargs.setdefault("replay_endpoint", LOOPBACK_ANY)
        kwargs.setdefault("topic", TOPIC)
        pub = ZmqEventPublisher(**kwargs)
        made.append(pub)
        return pub

    yield factory
    for pub in made:
        pub.shutdown()


def wait_subscribed(
    pub: ZmqEventPublisher, received_any: Callable[[float], bool], attempts: int = 200
) -> None:
    """Beat ZMQ's slow-joiner: publish probe batches until the subscriber sees one.

    ``received_any(timeout_s)`` polls the subscriber and says whether any batch
    arrived. Probes are ``AllBlocksCleared`` batches and consume seqs; callers
    use ``pub.next_seq`` afterwards as the first seq of their own batches.
    """
    for _ in range(attempts):
        pub.publish([AllBlocksCleared()])
        if received_any(0.05):
            # Let the remaining probes arrive and be drained, so that the
            # caller's first receive is its own batch.
            assert pub.flush(120.0)
            while received_any(0.05):
                pass
            return
    raise AssertionError("subscriber never received a probe batch")


class FakePublisher:
    """A test-scripted publisher: XPUB (to see the subscription) + ROUTER.

    ``replay_answers`` None: a replay socket that never answers. ``framing``
    "vllm" answers ``[b"", topic, seq, payload]`` / ``[b"", b"", END, b""]``
    (vLLM 0.33), "legacy" ``[b"", seq, payload]`` / ``[b"", END, b""]``.
    """

    def __init__(
        self, replay_answers: list[tuple[int, bytes]] | None, framing: str = "vllm"
    ) -> None:
        self.framing = framing
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind(LOOPBACK_ANY)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(LOOPBACK_ANY)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[int] = []
        self._answers = replay_answers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def wait_subscriber(self) -> None:
        assert self.pub.poll(5000)
        assert self.pub.recv()[0] == 1  # a subscribe message

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            ident, empty, start = self.router.recv_multipart()
            assert empty == b""
            self.requests.append(int.from_bytes(start, "big"))
            if self._answers is None:
                continue  # a replay socket that never answers
            topic = [TOPIC.encode()] if self.framing == "vllm" else []
            for seq, payload in self._answers:
                if seq >= self.requests[-1]:
                    self.router.send_multipart(
                        [ident, b"", *topic, seq.to_bytes(8, "big"), payload]
                    )
            end_topic = [b""] if self.framing == "vllm" else []
            self.router.send_multipart([ident, b"", *end_topic, END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()
