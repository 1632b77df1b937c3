"""The Redis / Valkey tier (standalone or Cluster): store, links, breaker, manager, handler.

``store`` keeps one checksummed value per block under a namespace derived
from the tier fingerprint; ``urls`` checks and redacts server URLs;
``links`` holds the connections (one server or a cluster's masters), each
behind a ``breaker`` that a ``probe`` reopens; ``manager`` is the
scheduler-side view of what the server holds, with ``presence`` learning it
off the scheduler thread; ``handler`` moves bytes between CPU slots and the
store; ``build`` opens the store and builds both sides over it.
"""

from kvoffload.tiers.redis.handler import RedisTransferHandler
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.redis.presence import PresenceCache
from kvoffload.tiers.redis.store import (
    RedisBlockStore,
    RedisStoreError,
    RedisStoreStats,
    namespace_prefix,
)
from kvoffload.tiers.redis.urls import (
    is_cluster_url,
    normalize_url,
    parse_cluster_url,
    redact_cluster_url,
    redact_url,
)

__all__ = [
    "PresenceCache",
    "RedisBlockStore",
    "RedisStoreError",
    "RedisStoreStats",
    "RedisTransferHandler",
    "RemoteOffloadingManager",
    "is_cluster_url",
    "namespace_prefix",
    "normalize_url",
    "parse_cluster_url",
    "redact_cluster_url",
    "redact_url",
]
