"""Secondary-tier ``OffloadingEvent``s as router-facing KV events."""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.events import BlockRemoved, BlockStored, KVEvent
from kvoffload.offload.base import OffloadingEvent, offload_key_block_hash


def offloading_events_to_kv_events(events: Iterable[OffloadingEvent]) -> list[KVEvent]:
    """``BlockStored`` / ``BlockRemoved`` with the tier as ``medium``.

    Stored events carry ``block_size=0`` and no tokens or parent: a router
    already has those from the GPU tier's event for the same hashes.
    """
    out: list[KVEvent] = []
    for ev in events:
        hashes: list[bytes | int] = [offload_key_block_hash(k) for k in ev.keys]
        if not hashes:
            continue
        if ev.removed:
            out.append(BlockRemoved(block_hashes=hashes, medium=ev.medium))
        else:
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=ev.medium,
                )
            )
    return out
