"""The Redis / Valkey tier's builder for ``kvoffload.tiers.stack`` (``TIER_BUILDERS``).

A malformed URL or rejected credentials raise here (one line, no
password); an unreachable server is only a warning: the tier starts in an
outage and its breaker reopens it when the server answers.
"""

from __future__ import annotations

from kvoffload.tiers.building import BuiltTier, TierContext
from kvoffload.tiers.config import TierConfig
from kvoffload.tiers.redis.handler import RedisTransferHandler
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.redis.presence import PresenceCache
from kvoffload.tiers.redis.store import RedisBlockStore


def open_store(
    config: TierConfig,
    block_bytes: int,
    fingerprint: str,
    hash_fn: str,
    *,
    retry_interval_s: float = 1.0,
    max_retry_interval_s: float = 30.0,
) -> RedisBlockStore:
    """The store of ``config``'s Redis keys (``redis_url`` set) for blocks of
    ``block_bytes`` under the tiers' ``fingerprint`` (kvoffload's tiers and vLLM's both)."""
    assert config.redis_url is not None
    return RedisBlockStore(
        config.redis_url,
        config.redis_namespace,
        block_bytes,
        ttl_s=config.redis_ttl_s,
        timeout_s=config.redis_timeout_s,
        geometry_fingerprint=fingerprint,
        hash_fn=hash_fn,
        retry_interval_s=retry_interval_s,
        max_retry_interval_s=max_retry_interval_s,
    )


def build_redis(ctx: TierContext) -> BuiltTier | None:
    """The Redis / Valkey tier (``config.redis_url``); None when unset."""
    config = ctx.config
    if not config.redis_url:
        return None
    store = open_store(config, ctx.slot_bytes, ctx.fingerprint, ctx.identity.hash_fn)

    def manager() -> RemoteOffloadingManager:
        presence = PresenceCache(store.contains_many) if config.redis_async_presence else None
        return RemoteOffloadingManager(
            store.contains_many,
            lambda: store.available,
            config.enable_events,
            presence=presence,
            ownership=store.ownership,
        )

    return BuiltTier.over(
        store, manager, lambda: RedisTransferHandler(store, ctx.host_pool, config.num_threads)
    )
