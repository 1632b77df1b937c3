"""CPU <-> DISK jobs: host pool slots to and from a ``DiskBlockStore``.

A job copies ``CPULoadStoreSpec`` slots to the ``DiskLoadStoreSpec`` slots
(and keys) the disk tier's manager chose, or back. It succeeds only if every
block moved: a block the store cannot return (missing, corrupt, truncated)
fails a load, and the CPU slots it was meant for must then be treated as
garbage (the manager never marks them valid). The handler decides nothing.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvoffload.offload.base import CPULoadStoreSpec
from kvoffload.offload.lower_tier import DISK_MEDIUM, DiskLoadStoreSpec
from kvoffload.tiers.disk.store import DiskBlockStore
from kvoffload.tiers.slot_io import SlotIO, SlotTierHandler, check_pair
from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)


class DiskTransferHandler(SlotTierHandler):
    """Runs CPU -> DISK and DISK -> CPU jobs on a thread pool (the store adds its own I/O pool)."""

    tier_spec = DiskLoadStoreSpec
    tier_medium = DISK_MEDIUM
    tier_noun = "disk"
    write_verb = "written"

    def __init__(self, store: DiskBlockStore, host_pool: HostPool, num_threads: int = 2) -> None:
        if store.block_bytes != host_pool.slot_bytes:
            raise ValueError(
                f"disk tier blocks are {store.block_bytes} bytes but CPU slots are "
                f"{host_pool.slot_bytes}: the store was opened for another geometry"
            )
        super().__init__(num_threads, thread_name_prefix="kvoffload-disk-job")
        self.store = store
        self.slots = SlotIO(host_pool)

    # -- synchronous copies (also used by the tiered handler) -----------------

    def write(self, src: CPULoadStoreSpec, dst: DiskLoadStoreSpec) -> list[bool]:
        """CPU slots -> disk slots; per block, whether it was stored."""
        check_pair(src, dst)
        if not len(dst):
            return []
        data = self.slots.gather(src.block_ids)
        return self.store.put(dst.keys, data, dst.block_ids.tolist())

    def read(self, src: DiskLoadStoreSpec, dst: CPULoadStoreSpec) -> list[bool]:
        """Disk slots -> CPU slots; per block, whether it is a verified hit (misses untouched
        in staging, garbage in place: either way not to be used)."""
        check_pair(src, dst)
        if not len(src):
            return []
        buf, staged = self.slots.reader(dst.block_ids)
        hit = self.store.get_into(src.keys, buf, src.block_ids.tolist())
        if staged:
            assert isinstance(buf, torch.Tensor)
            self.slots.scatter(dst.block_ids, buf, hit)
        return hit

    def read_blocks(self, src: DiskLoadStoreSpec) -> tuple[np.ndarray, list[bool]]:
        """Disk slots -> a fresh ``[n, block_bytes]`` array (for disk -> remote moves)."""
        out = np.empty((len(src), self.store.block_bytes), dtype=np.uint8)
        if not len(src):
            return out, []
        return out, self.store.get_into(src.keys, out, src.block_ids.tolist())
