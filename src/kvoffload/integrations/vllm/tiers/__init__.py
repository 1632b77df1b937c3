"""kvoffload's disk and Redis tiers as vLLM secondary tiers (``TieringOffloadingSpec``).

- ``KVOffloadDiskTier`` (``disk``): bounded, checksummed, evicting disk tier;
- ``KVOffloadRedisTier`` (``redis``): a shared Redis / Valkey (or Redis
  Cluster) tier with non-blocking pipelined presence checks and a breaker;
- ``KVOffloadMooncakeTier`` (``mooncake``): a Mooncake Store tier (the Redis
  tier's behaviour, vLLM's rows moved in place);
- ``base``: what both share (submit / finish, job results, events, stats);
  ``io_threads``, ``keys`` (an entry's keys), ``identity`` (the tier
  fingerprint, the tier's label) and ``metrics`` beside it.

Names resolve on first use: the Redis tier needs redis-py, the disk tier does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.integrations.vllm.tiers.disk import KVOffloadDiskTier
    from kvoffload.integrations.vllm.tiers.mooncake import KVOffloadMooncakeTier
    from kvoffload.integrations.vllm.tiers.redis import KVOffloadRedisTier

_WHERE = {
    "KVOffloadDiskTier": "disk",
    "KVOffloadRedisTier": "redis",
    "KVOffloadMooncakeTier": "mooncake",
}

__all__ = ["KVOffloadDiskTier", "KVOffloadMooncakeTier", "KVOffloadRedisTier"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
