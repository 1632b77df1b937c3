"""Assembling the disk and remote tiers behind a CPU tier: stores, managers, handlers.

``make_tiers(cpu, host_pool, gpu_tensors, layout, config, identity)`` takes
the one ``TierConfig`` every front end builds. One call builds both sides,
since each needs the other's facts at start-up: the disk manager is seeded
with the blocks the re-opened disk store still holds, and the remote
manager asks the remote store what the server has.
Errors in the configuration (an unwritable directory, a directory written
by an incompatible engine, a malformed Redis URL, rejected credentials) are
raised here, before the engine starts serving; an unreachable Redis server
is only a warning (the tier starts in an outage and recovers on its own).

Tier identity: both lower tiers are keyed by ``identity.tier_fingerprint``,
which covers the model (``model_id``, computed by the engine layer:
``kvoffload.engine.model_identity``), the KV geometry, dtype, quantisation
and layout, the block hash function and its seed, and the tensor-parallel
rank and size. A disk directory written under another fingerprint is
refused with a one-line ``DiskStoreMismatchError`` naming the differing
fields; a Redis server simply holds each fingerprint's blocks under its own
namespace prefix, so engines that differ never see each other's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.cpu_manager import CPUOffloadingManager
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.tiers.config import TierConfig, TierIdentity
from kvoffload.tiers.disk.handler import DiskTransferHandler
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.disk.store import DiskBlockStore
from kvoffload.tiers.identity import tier_fingerprint
from kvoffload.tiers.lower_tier import DISK_MEDIUM, REMOTE_MEDIUM, TIERED_MEDIUM, LowerTierManager
from kvoffload.tiers.redis.handler import RedisTransferHandler
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.redis.presence import PresenceCache
from kvoffload.tiers.redis.store import RedisBlockStore
from kvoffload.tiers.tiered_handler import TieredTransferHandler
from kvoffload.tiers.tiered_manager import TieredOffloadingManager
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.worker import OffloadingWorker, make_cpu_gpu_handler

CPU = CPU_MEDIUM
GPU = GPU_MEDIUM


@dataclass
class LowerTiers:
    """The assembled tiers: give ``manager`` to the connector, ``register`` the handlers."""

    manager: TieredOffloadingManager
    handler: TieredTransferHandler
    disk_store: DiskBlockStore | None = None
    redis_store: RedisBlockStore | None = None
    disk_handler: DiskTransferHandler | None = None
    redis_handler: RedisTransferHandler | None = None
    _closed: bool = field(default=False, repr=False)

    def register(self, worker: OffloadingWorker) -> None:
        """Route ``TIERED <-> GPU`` (and plain ``CPU <-> DISK/REMOTE``) jobs to these handlers."""
        worker.register_handler(TIERED_MEDIUM, GPU, self.handler)
        worker.register_handler(GPU, TIERED_MEDIUM, self.handler)
        if self.disk_handler is not None:
            worker.register_handler(CPU, DISK_MEDIUM, self.disk_handler)
            worker.register_handler(DISK_MEDIUM, CPU, self.disk_handler)
        if self.redis_handler is not None:
            worker.register_handler(CPU, REMOTE_MEDIUM, self.redis_handler)
            worker.register_handler(REMOTE_MEDIUM, CPU, self.redis_handler)

    def load_blocks_by_medium(self) -> dict[str, int]:
        """Offloaded blocks loaded from each tier (failed loads excluded)."""
        return self.manager.hit_blocks_by_medium()

    def close(self) -> None:
        """Close handlers and stores (the worker's ``close`` also closes registered handlers)."""
        if self._closed:
            return
        self._closed = True
        for tier in self.manager.lower:
            if isinstance(tier, RemoteOffloadingManager):
                tier.close()
        self.handler.close()
        for h in (self.disk_handler, self.redis_handler):
            if h is not None:
                h.close()
        if self.disk_store is not None:
            self.disk_store.close()
        if self.redis_store is not None:
            self.redis_store.close()


def make_tiers(
    cpu: CPUOffloadingManager,
    host_pool: HostPool,
    gpu_tensors: Sequence[torch.Tensor],
    layout: KVLayout,
    config: TierConfig,
    identity: TierIdentity,
) -> LowerTiers:
    """Disk (if ``config.disk_dir``) then remote (if ``config.redis_url``) tiers under ``cpu``.

    ``identity`` and the layout go into the tiers' fingerprint (module
    docstring). The disk budget is counted in CPU slots of ``host_pool``.
    """
    slot_bytes = host_pool.slot_bytes
    fingerprint = tier_fingerprint(
        layout,
        host_pool.block_size_factor,
        model_id=identity.model_id,
        hash_fn=identity.hash_fn,
        hash_seed=identity.hash_seed,
        kv_quant=identity.kv_quant,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
    )
    threads = config.num_threads
    lower: list[LowerTierManager] = []
    disk_store = redis_store = None
    disk_handler = redis_handler = None
    try:
        if config.disk_dir:
            disk_blocks = config.disk_slots(slot_bytes)
            disk_store = DiskBlockStore(
                config.disk_dir,
                slot_bytes,
                disk_blocks,
                fingerprint,
                hash_fn=identity.hash_fn,
                direct_io=config.direct_io,
            )
            restored = [(OffloadKey(e.key), e.slot) for e in disk_store.entries()]
            lower.append(
                DiskOffloadingManager(
                    disk_blocks, config.enable_events, restored, clear_store=disk_store.clear
                )
            )
            disk_handler = DiskTransferHandler(disk_store, host_pool, threads)
        if config.redis_url:
            redis_store = RedisBlockStore(
                config.redis_url,
                config.redis_namespace,
                slot_bytes,
                ttl_s=config.redis_ttl_s,
                timeout_s=config.redis_timeout_s,
                geometry_fingerprint=fingerprint,
                hash_fn=identity.hash_fn,
            )
            presence = (
                PresenceCache(redis_store.contains_many) if config.redis_async_presence else None
            )
            lower.append(
                RemoteOffloadingManager(
                    redis_store.contains_many,
                    lambda: redis_store.available,  # type: ignore[union-attr]
                    config.enable_events,
                    presence=presence,
                    ownership=redis_store.ownership,
                )
            )
            redis_handler = RedisTransferHandler(redis_store, host_pool, threads)
        manager = TieredOffloadingManager(cpu, lower, write_mode=config.write_mode)
        cpu_gpu = make_cpu_gpu_handler(gpu_tensors, layout, host_pool, threads)
        handler = TieredTransferHandler(cpu_gpu, disk_handler, redis_handler, 2 * threads)
    except BaseException:
        for tier in lower:
            if isinstance(tier, RemoteOffloadingManager):
                tier.close()
        for h in (disk_handler, redis_handler):
            if h is not None:
                h.close()
        for s in (disk_store, redis_store):
            if s is not None:
                s.close()
        raise
    return LowerTiers(manager, handler, disk_store, redis_store, disk_handler, redis_handler)
