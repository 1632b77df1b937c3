"""The disk tier: a bounded slab store with a crash-safe index, its manager and its handler.

``store`` keeps blocks in slab files under one directory (checksummed, keyed
by the tier fingerprint): the write / read protocol over ``slabs`` (the slab
files), ``catalog`` (which key is in which slot, in memory) and ``index``
(the append-only log that makes it survive a restart); ``manifest`` checks
that a directory was written for this model and geometry, and locks it;
``manager`` is the scheduler-side bookkeeping (which key is in which slot,
eviction, events); ``handler`` moves bytes between CPU slots and the store
on the worker side; ``build`` opens the store and builds both sides over it.
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
