"""The disk tier's builder for ``kvoffload.tiers.stack`` (``TIER_BUILDERS``).

Opening the store checks the directory (``DiskStoreError``,
``DiskStoreMismatchError``: one line each); the manager is seeded with the
blocks the re-opened directory still holds, oldest write first.
"""

from __future__ import annotations

from kvoffload.offload.base import OffloadKey
from kvoffload.tiers.building import BuiltTier, TierContext
from kvoffload.tiers.disk.handler import DiskTransferHandler
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.disk.store import DiskBlockStore


def build_disk(ctx: TierContext) -> BuiltTier | None:
    """The disk tier (``config.disk_dir``), its budget counted in CPU slots; None when unset."""
    config = ctx.config
    if not config.disk_dir:
        return None
    disk_blocks = config.disk_slots(ctx.slot_bytes)
    store = DiskBlockStore(
        config.disk_dir,
        ctx.slot_bytes,
        disk_blocks,
        ctx.fingerprint,
        hash_fn=ctx.identity.hash_fn,
        direct_io=config.direct_io,
    )

    def manager() -> DiskOffloadingManager:
        restored = [(OffloadKey(e.key), e.slot) for e in store.entries()]
        return DiskOffloadingManager(
            disk_blocks, config.enable_events, restored, clear_store=store.clear
        )

    return BuiltTier.over(
        store, manager, lambda: DiskTransferHandler(store, ctx.host_pool, config.num_threads)
    )
