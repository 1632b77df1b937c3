"""The Mooncake tier's builder for ``kvoffload.tiers.stack`` (``TIER_BUILDERS``).

Opening the store sets up a client against the master; a master that cannot
be reached at start-up is an error naming the URL (Mooncake's ``setup``
fails), unlike a Redis server, which may start in an outage: a Mooncake
client cannot be built without its master. Outages after start-up trip the
store's breaker instead (``probe``).
"""

from __future__ import annotations

from kvoffload.tiers.building import BuiltTier, TierContext
from kvoffload.tiers.config import TierConfig
from kvoffload.tiers.mooncake.handler import MooncakeTransferHandler
from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager
from kvoffload.tiers.mooncake.probe import PROBE_INTERVAL_S
from kvoffload.tiers.mooncake.store import MooncakeBlockStore


def open_store(
    config: TierConfig,
    block_bytes: int,
    fingerprint: str,
    hash_fn: str,
    *,
    probe_interval_s: float = PROBE_INTERVAL_S,
) -> MooncakeBlockStore:
    """The store of ``config``'s Mooncake keys (``mooncake_url`` set) for blocks of
    ``block_bytes`` under the tiers' ``fingerprint`` (kvoffload's tiers and vLLM's both)."""
    assert config.mooncake_url is not None
    return MooncakeBlockStore(
        config.mooncake_url,
        config.mooncake_namespace,
        block_bytes,
        geometry_fingerprint=fingerprint,
        hash_fn=hash_fn,
        metadata=config.mooncake_metadata,
        protocol=config.mooncake_protocol,
        segment_bytes=config.mooncake_segment_bytes,
        local_buffer_bytes=config.mooncake_local_buffer_bytes,
        probe_interval_s=probe_interval_s,
    )


def build_mooncake(ctx: TierContext) -> BuiltTier | None:
    """The Mooncake Store tier (``config.mooncake_url``); None when unset."""
    config = ctx.config
    if not config.mooncake_url:
        return None
    store = open_store(config, ctx.slot_bytes, ctx.fingerprint, ctx.identity.hash_fn)
    return BuiltTier.over(
        store,
        lambda: MooncakeOffloadingManager(store, config.enable_events),
        lambda: MooncakeTransferHandler(store, ctx.host_pool, config.num_threads),
    )
