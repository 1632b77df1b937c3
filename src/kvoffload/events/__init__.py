"""KV events: types, wire format, and the ZMQ publisher/subscriber.

The publisher and subscriber names load lazily, so that importing the event
types (as the block pool does) does not import ZMQ.
"""

import importlib
from typing import TYPE_CHECKING

from kvoffload.events.types import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

if TYPE_CHECKING:
    from kvoffload.events.publisher import (
        END_SEQ,
        EventPublisher,
        NullEventPublisher,
        PublisherStats,
        ZmqEventPublisher,
        make_publisher,
    )
    from kvoffload.events.subscriber import (
        GapReport,
        KVEventSubscriber,
        ReceivedBatch,
        SubscriberStats,
    )

_LAZY = {
    "END_SEQ": "kvoffload.events.publisher",
    "EventPublisher": "kvoffload.events.publisher",
    "NullEventPublisher": "kvoffload.events.publisher",
    "PublisherStats": "kvoffload.events.publisher",
    "ZmqEventPublisher": "kvoffload.events.publisher",
    "make_publisher": "kvoffload.events.publisher",
    "GapReport": "kvoffload.events.subscriber",
    "KVEventSubscriber": "kvoffload.events.subscriber",
    "ReceivedBatch": "kvoffload.events.subscriber",
    "SubscriberStats": "kvoffload.events.subscriber",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_REMOTE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventPublisher",
    "ExternalBlockHash",
    "GapReport",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventSubscriber",
    "NullEventPublisher",
    "PublisherStats",
    "ReceivedBatch",
    "SubscriberStats",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "make_publisher",
]
