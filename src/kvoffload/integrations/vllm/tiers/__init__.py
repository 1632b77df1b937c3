"""kvoffload's disk and Redis tiers as vLLM secondary tiers (``TieringOffloadingSpec``).

- ``KVOffloadDiskTier`` (``disk``): bounded, checksummed, evicting disk tier;
- ``KVOffloadRedisTier`` (``redis``): a shared Redis / Valkey (or Redis
  Cluster) tier with non-blocking pipelined presence checks and a breaker;
- ``KVOffloadMooncakeTier`` (``mooncake``): a Mooncake Store tier (the Redis
  tier's behaviour, vLLM's rows moved in place);
- ``base``: what they share (submit / finish, job results, events, stats, and
  ``KVOffloadStoreTier``, the constructor every tier uses);
  ``io_threads``, ``keys`` (an entry's keys), ``identity`` (the tier
  fingerprint, the tier's label) and ``metrics`` beside it.

Names resolve on first use: the Redis tier needs redis-py, the disk tier does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:
    from kvoffload.integrations.vllm.tiers.disk import KVOffloadDiskTier
    from kvoffload.integrations.vllm.tiers.mooncake import KVOffloadMooncakeTier
    from kvoffload.integrations.vllm.tiers.redis import KVOffloadRedisTier

_WHERE = {
    "KVOffloadDiskTier": f"{__name__}.disk",
    "KVOffloadRedisTier": f"{__name__}.redis",
    "KVOffloadMooncakeTier": f"{__name__}.mooncake",
}

__all__ = ["KVOffloadDiskTier", "KVOffloadMooncakeTier", "KVOffloadRedisTier"]

__getattr__ = lazy_exports(__name__, _WHERE)
