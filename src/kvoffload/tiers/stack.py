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

Each tier folder has one builder (``disk/build.py``, ``redis/build.py``,
``mooncake/build.py``; the contract is ``building``'s): it opens the tier's
store and returns a ``BuiltTier`` (manager, handler, store).
``TIER_BUILDERS`` lists them in stacking order (a new tier adds its builder
there). ``make_tiers`` stacks what they build and closes every tier already
built when a later one fails.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kvoffload.offload.cpu_manager import CPUOffloadingManager
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.tiers.building import BuiltTier, TierContext
from kvoffload.tiers.config import TierConfig, TierIdentity
from kvoffload.tiers.disk.build import build_disk
from kvoffload.tiers.disk.store import DiskBlockStore
from kvoffload.tiers.identity import tier_fingerprint
from kvoffload.tiers.lower_tier import TIERED_MEDIUM
from kvoffload.tiers.mooncake.build import build_mooncake
from kvoffload.tiers.redis.build import build_redis
from kvoffload.tiers.redis.store import RedisBlockStore
from kvoffload.tiers.tiered_handler import TieredTransferHandler
from kvoffload.tiers.tiered_manager import TieredOffloadingManager
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.worker import OffloadingWorker, make_cpu_gpu_handler

__all__ = ["TIER_BUILDERS", "BuiltTier", "LowerTiers", "TierContext", "make_tiers"]

CPU = CPU_MEDIUM
GPU = GPU_MEDIUM
T = TypeVar("T")


@dataclass
class LowerTiers:
    """The assembled tiers: give ``manager`` to the connector, ``register`` the handlers.

    ``tiers`` are the lower tiers in stacking order; ``disk_store`` and
    ``redis_store`` name those two tiers' stores (None when not configured).
    """

    manager: TieredOffloadingManager
    handler: TieredTransferHandler
    tiers: list[BuiltTier] = field(default_factory=list)
    _closed: bool = field(default=False, repr=False)

    def _store(self, kind: type[T]) -> T | None:
        return next((t.store for t in self.tiers if isinstance(t.store, kind)), None)

    @property
    def disk_store(self) -> DiskBlockStore | None:
        return self._store(DiskBlockStore)

    @property
    def redis_store(self) -> RedisBlockStore | None:
        return self._store(RedisBlockStore)

    def register(self, worker: OffloadingWorker) -> None:
        """Route ``TIERED <-> GPU`` (and plain ``CPU <-> tier``) jobs to these handlers."""
        worker.register_handler(TIERED_MEDIUM, GPU, self.handler)
        worker.register_handler(GPU, TIERED_MEDIUM, self.handler)
        for tier in self.tiers:
            worker.register_handler(CPU, tier.handler.tier_medium, tier.handler)
            worker.register_handler(tier.handler.tier_medium, CPU, tier.handler)

    def load_blocks_by_medium(self) -> dict[str, int]:
        """Offloaded blocks loaded from each tier (failed loads excluded)."""
        return self.manager.hit_blocks_by_medium()

    def close(self) -> None:
        """Close handlers and stores (the worker's ``close`` also closes registered handlers)."""
        if self._closed:
            return
        self._closed = True
        self.handler.close()
        for tier in self.tiers:
            tier.close()


#: The lower tiers in stacking order (a lookup asks them in this order).
TIER_BUILDERS: tuple[Callable[[TierContext], BuiltTier | None], ...] = (
    build_disk,
    build_redis,
    build_mooncake,
)


def make_tiers(
    cpu: CPUOffloadingManager,
    host_pool: HostPool,
    gpu_tensors: Sequence[torch.Tensor],
    layout: KVLayout,
    config: TierConfig,
    identity: TierIdentity,
) -> LowerTiers:
    """The configured tiers of ``TIER_BUILDERS`` (disk, then remote) under ``cpu``.

    ``identity`` and the layout go into the tiers' fingerprint (module
    docstring). The disk budget is counted in CPU slots of ``host_pool``.
    """
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
    ctx = TierContext(config, identity, host_pool, fingerprint)
    threads = config.num_threads
    built: list[BuiltTier] = []
    try:
        for build in TIER_BUILDERS:
            tier = build(ctx)
            if tier is not None:
                built.append(tier)
        manager = TieredOffloadingManager(
            cpu, [t.manager for t in built], write_mode=config.write_mode
        )
        cpu_gpu = make_cpu_gpu_handler(gpu_tensors, layout, host_pool, threads)
        handler = TieredTransferHandler(cpu_gpu, [t.handler for t in built], 2 * threads)
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return LowerTiers(manager, handler, built)
