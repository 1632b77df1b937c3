"""CPU <-> Mooncake jobs: the CPU tier's slots put and got in place, no staging copy.

Where the host pool is one contiguous region (``SlotIO.zero_copy``), the
handler registers it with the Mooncake client once, beside an array of one
16-byte header per slot, and each block moves as two buffers of one object:
its header and its slot (``MooncakeBlockStore.put_views`` / ``get_views``).
A slot belongs to one job at a time, so its header row needs no lock.
Other layouts gather the slots into a staging array (and scatter them back),
the one copy any tier makes for them; over TCP that array is registered for
the call (~5 us) and moved the same way, over RDMA (where registering costs
milliseconds) the store's byte path takes it. A job succeeds only if every
block moved; the handler decides nothing about what to store or load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvoffload.tiers.lower_tier import REMOTE_MEDIUM, RemoteLoadStoreSpec
from kvoffload.tiers.mooncake.store import HEADER_BYTES, MooncakeBlockStore
from kvoffload.tiers.slot_io import SlotTierHandler, check_pair
from kvoffload.transfer.host_pool import HostPool

#: ``MooncakeBlockStore.put_views`` / ``get_views``: keys, payload views, header rows.
MoveViews = Callable[[Sequence[bytes], Sequence[np.ndarray], Sequence[np.ndarray]], list[bool]]


class MooncakeTransferHandler(SlotTierHandler):
    """Runs CPU -> REMOTE and REMOTE -> CPU jobs against a Mooncake Store."""

    tier_spec = RemoteLoadStoreSpec
    tier_medium = REMOTE_MEDIUM
    tier_noun = "Mooncake"
    thread_prefix = "kvoffload-mooncake-job"
    write_verb = "stored"

    store: MooncakeBlockStore

    def __init__(
        self, store: MooncakeBlockStore, host_pool: HostPool, num_threads: int = 2
    ) -> None:
        super().__init__(store, host_pool, num_threads)
        self._headers: np.ndarray | None = None
        base = self.slots.views([0]) if host_pool.num_slots else None
        if base is not None:
            # Slot 0 starts the pool's one contiguous region (SlotIO.zero_copy).
            store.register(base[0].ctypes.data, host_pool.num_slots * host_pool.slot_bytes)
            self._headers = np.zeros((host_pool.num_slots, HEADER_BYTES), dtype=np.uint8)
            store.register(self._headers.ctypes.data, self._headers.nbytes)

    @property
    def zero_copy(self) -> bool:
        """Whether blocks move straight between the pool's slots and the store."""
        return self._headers is not None

    def write(self, src: Any, dst: Any) -> list[bool]:
        """CPU slots -> Mooncake; per block, whether the store accepted it."""
        if self._headers is None:
            return self._write_staged(src, dst)
        return self._in_place(src, dst, dst.keys, src.block_ids, self.store.put_views)

    def read(self, src: Any, dst: Any) -> list[bool]:
        """Mooncake -> CPU slots; per block, whether it is a verified hit (a miss leaves
        garbage in its slot: not to be used)."""
        if self._headers is None:
            return self._read_staged(src, dst)
        return self._in_place(src, dst, src.keys, dst.block_ids, self.store.get_views)

    def _in_place(
        self, src: Any, dst: Any, keys: Sequence[bytes], slot_ids: Any, call: MoveViews
    ) -> list[bool]:
        """``call`` (``put_views`` / ``get_views``) on ``keys`` and their slots, each block
        with its slot's header row."""
        check_pair(src, dst)
        if not len(dst):
            return []
        views = self.slots.views(slot_ids)
        assert views is not None and self._headers is not None
        headers = [self._headers[int(s)] for s in slot_ids]
        return call(keys, views, headers)

    def _write_staged(self, src: Any, dst: Any) -> list[bool]:
        if self.store.protocol != "tcp":
            return super().write(src, dst)
        check_pair(src, dst)
        if not len(dst):
            return []
        staged = self.slots.gather(src.block_ids)
        assert isinstance(staged, torch.Tensor)  # not zero-copy: a gathered copy
        rows = staged.numpy()
        heads = np.zeros((len(rows), HEADER_BYTES), dtype=np.uint8)
        with self.store.registered(rows, heads):
            return self.store.put_views(dst.keys, list(rows), list(heads))

    def _read_staged(self, src: Any, dst: Any) -> list[bool]:
        if self.store.protocol != "tcp":
            return super().read(src, dst)
        check_pair(src, dst)
        if not len(src):
            return []
        buf, staged = self.slots.reader(dst.block_ids)
        assert staged and isinstance(buf, torch.Tensor)
        rows = buf.numpy()
        heads = np.zeros((len(rows), HEADER_BYTES), dtype=np.uint8)
        with self.store.registered(rows, heads):
            hit = self.store.get_views(src.keys, list(rows), list(heads))
        self.slots.scatter(dst.block_ids, buf, hit)
        return hit
