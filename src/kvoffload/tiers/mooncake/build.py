"""The Mooncake tier's builder for ``kvoffload.tiers.stack`` (``TIER_BUILDERS``).

Opening the store sets up a client against the master; a master that cannot
be reached at start-up is an error naming the URL (Mooncake's ``setup``
fails), unlike a Redis server, which may start in an outage: a Mooncake
client cannot be built without its master. Outages after start-up trip the
store's breaker instead (``probe``).
"""

from __future__ import annotations

from kvoffload.tiers.building import BuiltTier, TierContext
from kvoffload.tiers.mooncake.handler import MooncakeTransferHandler
from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager
from kvoffload.tiers.mooncake.store import MooncakeBlockStore


def build_mooncake(ctx: TierContext) -> BuiltTier | None:
    """The Mooncake Store tier (``config.mooncake_url``); None when unset."""
    config = ctx.config
    if not config.mooncake_url:
        return None
    store = MooncakeBlockStore(
        config.mooncake_url,
        config.mooncake_namespace,
        ctx.slot_bytes,
        geometry_fingerprint=ctx.fingerprint,
        hash_fn=ctx.identity.hash_fn,
        metadata=config.mooncake_metadata,
        protocol=config.mooncake_protocol,
        segment_bytes=config.mooncake_segment_bytes,
        local_buffer_bytes=config.mooncake_local_buffer_bytes,
    )
    return BuiltTier.over(
        store,
        lambda: MooncakeOffloadingManager(store, config.enable_events),
        lambda: MooncakeTransferHandler(store, ctx.host_pool, config.num_threads),
    )
