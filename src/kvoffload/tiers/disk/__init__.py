"""The disk tier: a bounded slab store with a crash-safe index, its manager and its handler.

``store`` keeps blocks in slab files under one directory (checksummed, keyed
by the tier fingerprint); ``index`` is the append-only index log; ``slabs``
the slab files; ``manager`` the scheduler-side bookkeeping (which key is in
which slot, eviction, events); ``handler`` moves bytes between CPU slots and
the store on the worker side.
"""

from kvoffload.tiers.disk.handler import DiskTransferHandler
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.disk.slabs import DiskStoreError, DiskStoreMismatchError
from kvoffload.tiers.disk.store import DiskBlockStore, DiskStoreStats

__all__ = [
    "DiskBlockStore",
    "DiskOffloadingManager",
    "DiskStoreError",
    "DiskStoreMismatchError",
    "DiskStoreStats",
    "DiskTransferHandler",
]
