"""KV events: types, the two wire profiles ("vllm", the default, and "legacy"),
and the ZMQ publisher/subscriber.

The publisher and subscriber names load lazily, so that importing the event
types (as the block pool does) does not import ZMQ.
"""

import importlib
from typing import TYPE_CHECKING

from kvoffload.events.types import (
    DEFAULT_PROFILE,
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    MEDIUM_STORAGE,
    PROFILE_LEGACY,
    PROFILE_VLLM,
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    check_profile,
    decode_batch,
    decode_batch_profile,
    encode_batch,
    kvoffload_medium,
    vllm_block_hash,
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
    "DEFAULT_PROFILE",
    "END_SEQ",
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_REMOTE",
    "MEDIUM_STORAGE",
    "PROFILES",
    "PROFILE_LEGACY",
    "PROFILE_VLLM",
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
    "check_profile",
    "decode_batch",
    "decode_batch_profile",
    "encode_batch",
    "kvoffload_medium",
    "make_publisher",
    "vllm_block_hash",
]
