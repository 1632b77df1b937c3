"""KV cache event types, wire-compatible with vLLM's ``kv_events`` module.

Each event is a tagged, array-like msgspec struct, so plain msgpack decodes an
event as ``[tag, field0, field1, ...]`` in the field order below. That order is
what routers written against vLLM (llm-d, Dynamo) index into: never reorder,
only append new optional fields at the end.
"""

from __future__ import annotations

import msgspec

#: A block hash as it travels on the wire: raw bytes (ours) or int (older vLLM).
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[object]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """A run of consecutive blocks of one chain became resident in ``medium``.

    ``parent_block_hash`` is the hash of the block before the first one here
    (None at the start of a chain). Secondary tiers send ``block_size=0`` and
    no token ids: consumers take those from the GPU tier's event.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)
