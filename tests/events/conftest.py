"""Fixtures for the KV events tests: publishers on loopback with OS-chosen ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.events.types import AllBlocksCleared

TOPIC = "kv-events"
LOOPBACK_ANY = "tcp://127.0.0.1:*"

PublisherFactory = Callable[..., ZmqEventPublisher]


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
            assert pub.flush()
            while received_any(0.05):
                pass
            return
    raise AssertionError("subscriber never received a probe batch")
