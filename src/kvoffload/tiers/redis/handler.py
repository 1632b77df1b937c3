"""CPU <-> REMOTE jobs: host pool slots to and from a ``RedisBlockStore``.

A job succeeds only if every block moved. During an outage the store answers
at once (misses, failed stores), so these jobs fail fast instead of hanging;
the handler decides nothing about what to store or load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvoffload.offload.base import CPULoadStoreSpec
from kvoffload.offload.lower_tier import REMOTE_MEDIUM, RemoteLoadStoreSpec
from kvoffload.tiers.redis.store import RedisBlockStore
from kvoffload.tiers.slot_io import SlotIO, SlotTierHandler, check_pair
from kvoffload.transfer.host_pool import HostPool


class RedisTransferHandler(SlotTierHandler):
    """Runs CPU -> REMOTE and REMOTE -> CPU jobs on a thread pool."""

    tier_spec = RemoteLoadStoreSpec
    tier_medium = REMOTE_MEDIUM
    tier_noun = "remote"
    write_verb = "stored"

    def __init__(self, store: RedisBlockStore, host_pool: HostPool, num_threads: int = 2) -> None:
        if store.block_bytes != host_pool.slot_bytes:
            raise ValueError(
                f"remote tier blocks are {store.block_bytes} bytes but CPU slots are "
                f"{host_pool.slot_bytes}: the store was made for another geometry"
            )
        super().__init__(num_threads, thread_name_prefix="kvoffload-redis-job")
        self.store = store
        self.slots = SlotIO(host_pool)

    # -- synchronous copies (also used by the tiered handler) -----------------

    def write(self, src: CPULoadStoreSpec, dst: RemoteLoadStoreSpec) -> list[bool]:
        """CPU slots -> the server; per block, whether it accepted it."""
        check_pair(src, dst)
        if not len(dst):
            return []
        return self.store.put(dst.keys, self.slots.gather(src.block_ids))

    def write_blocks(self, keys: Sequence[bytes], data: Any) -> list[bool]:
        """Serialised blocks (e.g. read from disk) -> the server."""
        return self.store.put(keys, data) if len(keys) else []

    def read(self, src: RemoteLoadStoreSpec, dst: CPULoadStoreSpec) -> list[bool]:
        """The server -> CPU slots; per block, whether it is a verified hit."""
        check_pair(src, dst)
        if not len(src):
            return []
        buf, staged = self.slots.reader(dst.block_ids)
        hit = self.store.get_into(src.keys, buf)
        if staged:
            assert isinstance(buf, torch.Tensor)
            self.slots.scatter(dst.block_ids, buf, hit)
        return hit
