"""KV events: types, the two wire profiles ("vllm", the default, and "legacy"),
and the ZMQ publisher/subscriber.

What the events mean (the rule every producer in kvoffload follows, so a
router that keeps one entry per hash, as Dynamo's and llm-d's indexers do,
is exact): per instance, per tier (``medium``, with ``locality``) and per KV
cache group (``group_idx``), the stream describes the *set* of block hashes
held. ``BlockStored`` announces a hash when the tier first holds it and
``BlockRemoved`` when its last copy leaves; two running requests that
computed the same block hold two GPU copies, and evicting one announces
nothing. ``AllBlocksCleared`` empties the GPU tier's set (the offloaded
tiers announce their removals per hash: vLLM's ``AllBlocksCleared`` has no
medium). Replay re-sends the very batches that were published, so a late
subscriber that replays from the first sequence number builds the same
sets. An engine's stream starts with ``AllBlocksCleared`` (seq 0): a
consumer that still holds entries of an earlier incarnation of the same
instance (a restart on the same endpoint) drops them, for every tier; a
persistent tier (disk) then announces again what it still holds. vLLM
0.33's per-copy stream (one event per cached or evicted copy, for consumers
that reference-count) is the events mode ``"per-copy"``
(``EngineConfig.events_mode``, ``kvoffload run --events-mode per-copy``).

Offloaded tiers (CPU, STORAGE) are self-describing by default in
``kvoffload run``: their stores carry token ids, parent hash, block size,
LoRA, extra keys and the group fields (``kvoffload.engine.connector.events``), as
vLLM 0.33's ``self_describing_kv_events`` does. The Redis tier is shared by
instances: each instance announces the blocks it stored there (and withdraws
those it finds gone or stops tracking) as ``medium="STORAGE",
locality="REMOTE"`` with ``ownership`` naming the shared tier
(``"redis:<namespace>:<compatibility digest>"``). Instances that name the
same ownership load each other's blocks, so a router indexes the union of
their REMOTE sets as held by every one of them.

The publisher and subscriber names load lazily, so that importing the event
types (as the block pool does) does not import ZMQ.
"""

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports
from kvoffload.events.types import (
    DEFAULT_PROFILE,
    EVENTS_EXACT,
    EVENTS_MODES,
    EVENTS_PER_COPY,
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
    check_events_mode,
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


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "DEFAULT_PROFILE",
    "END_SEQ",
    "EVENTS_EXACT",
    "EVENTS_MODES",
    "EVENTS_PER_COPY",
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
    "check_events_mode",
    "check_profile",
    "decode_batch",
    "decode_batch_profile",
    "encode_batch",
    "kvoffload_medium",
    "make_publisher",
    "vllm_block_hash",
]
