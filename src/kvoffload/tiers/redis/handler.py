"""CPU <-> REMOTE jobs: host pool slots to and from a ``RedisBlockStore``.

A job succeeds only if every block moved. During an outage the store answers
at once (misses, failed stores), so these jobs fail fast instead of hanging;
the handler decides nothing about what to store or load. The copies
themselves are ``SlotTierHandler``'s (the server places blocks by key).
"""

from __future__ import annotations

from kvoffload.tiers.lower_tier import REMOTE_MEDIUM, RemoteLoadStoreSpec
from kvoffload.tiers.redis.store import RedisBlockStore
from kvoffload.tiers.slot_io import SlotTierHandler
from kvoffload.transfer.host_pool import HostPool


class RedisTransferHandler(SlotTierHandler):
    """Runs CPU -> REMOTE and REMOTE -> CPU jobs on a thread pool."""

    tier_spec = RemoteLoadStoreSpec
    tier_medium = REMOTE_MEDIUM
    tier_noun = "remote"
    thread_prefix = "kvoffload-redis-job"
    write_verb = "stored"

    store: RedisBlockStore

    def __init__(self, store: RedisBlockStore, host_pool: HostPool, num_threads: int = 2) -> None:
        super().__init__(store, host_pool, num_threads)
