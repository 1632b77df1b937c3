"""CPU slots as the byte blocks the disk and remote tiers store.

A lower tier stores one CPU slot per block, serialised as ``HostPool.read_slots``
lays it out (sub-block, then plane). Where a slot already is one contiguous
run of bytes in the pool (the ``cross_layer`` layout, one plane), the stores
read and write the pool's memory directly; otherwise slots are gathered into
(or scattered from) a staging tensor, one copy.

The tier fingerprint lives in ``kvoffload.tiers.identity``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from kvoffload.offload.base import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.transfer.handler import ThreadPoolTransferHandler, Work
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.spec import TransferSpec


class BlocksMissing(RuntimeError):
    """Some blocks of a copy could not be read or written; the job fails."""


def check_pair(src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
    """A copy pairs blocks one to one: both sides name as many."""
    n_src, n_dst = len(src), len(dst)  # type: ignore[arg-type]
    if n_src != n_dst:
        raise ValueError(f"{src.medium()} -> {dst.medium()} copy of {n_src} blocks into {n_dst}")


class SlotIO:
    """Reads and writes serialised slots of one host pool."""

    def __init__(self, host_pool: HostPool) -> None:
        self.pool = host_pool
        self.slot_bytes = host_pool.slot_bytes
        planes = host_pool.planes
        self._flat: torch.Tensor | None = None
        if len(planes) == 1 and planes[0].is_contiguous():
            # One contiguous plane: slot s is rows s*f .. s*f+f-1, back to back.
            self._flat = planes[0].reshape(host_pool.num_slots, self.slot_bytes)
        self._row_bytes = host_pool.layout.plane_row_bytes
        # torch's index kernels go element by element: 8-byte elements are far
        # faster than bytes, where rows and plane addresses allow them.
        wide = self._row_bytes % 8 == 0 and all(
            p.stride(0) % 8 == 0 and p.data_ptr() % 8 == 0 for p in planes
        )
        self._planes = [p.view(torch.int64) for p in planes] if wide else None

    @property
    def zero_copy(self) -> bool:
        """Whether the stores move bytes straight into and out of the pool."""
        return self._flat is not None

    def views(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray] | None:
        """Per slot, a uint8 view of its bytes in the pool; None when slots are not contiguous."""
        if self._flat is None:
            return None
        ids = self.pool.check_slots(slots)
        flat = self._flat.numpy()
        return [flat[int(s)] for s in ids]

    def gather(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray] | torch.Tensor:
        """The slots' bytes to write down: views when possible, else a gathered copy."""
        views = self.views(slots)
        if views is not None:
            return views
        if self._planes is None:
            return self.pool.read_slots(slots)
        rows = torch.from_numpy(self.pool.sub_block_ids(slots))
        out = torch.empty((rows.numel(), len(self._planes), self._row_bytes), dtype=torch.uint8)
        wide = out.view(torch.int64)
        for p, plane in enumerate(self._planes):
            wide[:, p] = plane.index_select(0, rows)
        return out.view(-1, self.slot_bytes)

    def reader(
        self, slots: Sequence[int] | np.ndarray
    ) -> tuple[list[np.ndarray] | torch.Tensor, bool]:
        """Where a store should put the slots' bytes, and whether a ``scatter`` must follow."""
        views = self.views(slots)
        if views is not None:
            return views, False
        ids = self.pool.check_slots(slots)
        return torch.empty((len(ids), self.slot_bytes), dtype=torch.uint8), True

    def scatter(
        self, slots: Sequence[int] | np.ndarray, staging: torch.Tensor, hit: Sequence[bool]
    ) -> None:
        """Copy the staged rows that were hits into their slots (misses are left alone)."""
        ids = np.asarray(slots, dtype=np.int64)
        mask = np.asarray(hit, dtype=bool)
        if not mask.any():
            return
        if not mask.all():
            ids = ids[mask]
            staging = staging.index_select(0, torch.from_numpy(np.flatnonzero(mask)))
        if self._planes is None:
            self.pool.write_slots(ids, staging)
            return
        rows = torch.from_numpy(self.pool.sub_block_ids(ids))
        src = staging.reshape(rows.numel(), len(self._planes), self._row_bytes).view(torch.int64)
        for p, plane in enumerate(self._planes):
            plane.index_copy_(0, rows, src[:, p])


class SlotStore(Protocol):
    """What every slot tier's store offers: blocks of ``block_bytes`` under keys, in batches.

    Their ``put`` / ``get_into`` differ in where a block goes: the disk
    store takes a slot per block, stores that place blocks themselves
    (Redis) take none. The base handler therefore calls them with the
    subclass's ``placement`` (``store.put(keys, blocks, *placement)``), and
    each subclass types ``store`` as its own store class. Both calls return,
    per block, whether it moved (a read: a verified hit).
    """

    @property
    def block_bytes(self) -> int: ...


class SlotTierHandler(ThreadPoolTransferHandler):
    """CPU <-> one lower tier whose store keeps serialised slots (the disk and remote handlers).

    ``store`` is a ``SlotStore`` whose ``block_bytes`` equal the pool's slot
    bytes. Subclasses name their tier in the class attributes and say where
    the store puts a block (``placement``); this base moves the bytes
    (``write``/``read`` return per block whether it moved), validates jobs
    and turns a partial copy into ``BlocksMissing``. It decides nothing.
    """

    #: The tier's ``LoadStoreSpec`` class and medium name.
    tier_spec: ClassVar[type[LoadStoreSpec]]
    tier_medium: ClassVar[str]
    #: How errors name the tier's blocks ("disk") and a failed write ("written").
    tier_noun: ClassVar[str]
    write_verb: ClassVar[str]
    #: Names the job threads ("kvoffload-disk-job-0", ...).
    thread_prefix: ClassVar[str]

    store: Any
    slots: SlotIO

    def __init__(self, store: SlotStore, host_pool: HostPool, num_threads: int = 2) -> None:
        if store.block_bytes != host_pool.slot_bytes:
            raise ValueError(
                f"{self.tier_noun} tier blocks are {store.block_bytes} bytes but CPU slots are "
                f"{host_pool.slot_bytes}: the store was made for another geometry"
            )
        super().__init__(num_threads, thread_name_prefix=self.thread_prefix)
        self.store = store
        self.slots = SlotIO(host_pool)

    def placement(self, spec: Any) -> tuple[Sequence[int], ...]:
        """The store's ``where`` arguments for the blocks of ``spec`` (none by default)."""
        return ()

    def keys_of(self, spec: Any) -> list[bytes]:
        """The keys of the blocks of ``spec`` (every tier's spec names them)."""
        return list(spec.keys)

    # -- synchronous copies (also used by the tiered handler) -----------------

    def write(self, src: Any, dst: Any) -> list[bool]:
        """CPU slots -> the tier; per block, whether it was stored."""
        check_pair(src, dst)
        if not len(dst):
            return []
        return self.store.put(dst.keys, self.slots.gather(src.block_ids), *self.placement(dst))

    def read(self, src: Any, dst: Any) -> list[bool]:
        """The tier -> CPU slots; per block, whether it is a verified hit (misses untouched
        in staging, garbage in place: either way not to be used)."""
        check_pair(src, dst)
        if not len(src):
            return []
        buf, staged = self.slots.reader(dst.block_ids)
        hit = self.store.get_into(src.keys, buf, *self.placement(src))
        if staged:
            assert isinstance(buf, torch.Tensor)
            self.slots.scatter(dst.block_ids, buf, hit)
        return hit

    def read_blocks(self, src: Any) -> tuple[np.ndarray, list[bool]]:
        """The tier -> a fresh ``[n, block_bytes]`` array (for moves between tiers)."""
        out = np.empty((len(src), self.store.block_bytes), dtype=np.uint8)
        if not len(src):
            return out, []
        return out, self.store.get_into(src.keys, out, *self.placement(src))

    def write_blocks(self, keys: Sequence[bytes], data: Any, *where: Sequence[int]) -> list[bool]:
        """Serialised blocks (e.g. read from another tier) -> the tier."""
        return self.store.put(keys, data, *where) if len(keys) else []

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        """Run one copy; raises ``BlocksMissing`` unless every block moved. Returns bytes."""
        cpu, tier = CPULoadStoreSpec.medium(), self.tier_medium
        if isinstance(src, CPULoadStoreSpec) and isinstance(dst, self.tier_spec):
            ok = self.write(src, dst)
        elif isinstance(src, self.tier_spec) and isinstance(dst, CPULoadStoreSpec):
            ok = self.read(src, dst)
        else:
            raise ValueError(f"cannot copy {src.medium()} -> {dst.medium()} ({cpu}<->{tier} only)")
        bad = len(ok) - sum(ok)
        if bad:
            verb = self.write_verb if dst.medium() == tier else "read"
            raise BlocksMissing(f"{bad} of {len(ok)} {self.tier_noun} blocks could not be {verb}")
        return len(ok) * self.store.block_bytes

    def prepare(self, job_id: int, spec: TransferSpec) -> Work:
        src, dst = spec.src, spec.dst
        cpu, tier = CPULoadStoreSpec.medium(), self.tier_medium
        if spec.media not in ((cpu, tier), (tier, cpu)):
            raise ValueError(
                f"cannot transfer {spec.media[0]} -> {spec.media[1]} ({cpu}<->{tier} only)"
            )
        check_pair(src, dst)
        cpu_spec = dst if isinstance(dst, CPULoadStoreSpec) else src
        self.slots.pool.check_slots(cpu_spec.block_ids)  # type: ignore[attr-defined]
        return lambda: self.copy(src, dst)
