"""CPU <-> DISK jobs: host pool slots to and from a ``DiskBlockStore``.

A job copies ``CPULoadStoreSpec`` slots to the ``DiskLoadStoreSpec`` slots
(and keys) the disk tier's manager chose, or back. It succeeds only if every
block moved: a block the store cannot return (missing, corrupt, truncated)
fails a load, and the CPU slots it was meant for must then be treated as
garbage (the manager never marks them valid). The handler decides nothing;
the copies themselves are ``SlotTierHandler``'s.
"""

from __future__ import annotations

from kvoffload.tiers.disk.store import DiskBlockStore
from kvoffload.tiers.lower_tier import DISK_MEDIUM, DiskLoadStoreSpec
from kvoffload.tiers.slot_io import SlotTierHandler
from kvoffload.transfer.host_pool import HostPool


class DiskTransferHandler(SlotTierHandler):
    """Runs CPU -> DISK and DISK -> CPU jobs on a thread pool (the store adds its own I/O pool)."""

    tier_spec = DiskLoadStoreSpec
    tier_medium = DISK_MEDIUM
    tier_noun = "disk"
    thread_prefix = "kvoffload-disk-job"
    write_verb = "written"

    store: DiskBlockStore

    def __init__(self, store: DiskBlockStore, host_pool: HostPool, num_threads: int = 2) -> None:
        super().__init__(store, host_pool, num_threads)

    def placement(self, spec: DiskLoadStoreSpec) -> tuple[list[int]]:
        """The disk slots the manager chose for the blocks."""
        return (spec.block_ids.tolist(),)
