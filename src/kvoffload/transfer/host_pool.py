"""The CPU tier's memory: one host tensor region addressed by CPU slot id.

A slot holds ``block_size_factor`` consecutive GPU-sized *sub-blocks*; slot
``s`` is sub-blocks ``s * f .. s * f + f - 1``. The region uses the same layout
kind as the engine's KV tensors (with ``num_slots * f`` blocks), so a copy
between them pairs plane ``p`` of one with plane ``p`` of the other and moves
whole rows. The pool only holds bytes; which slot holds what is the CPU
offloading manager's business.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvoffload.transfer.host_memory import host_buffer, pin_in_place, unpin
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.sizing import num_cpu_blocks


class HostPool:
    """``num_slots`` CPU slots of ``block_size_factor`` GPU blocks each, in one region.

    The region is page-locked when ``pin_memory`` is requested and CUDA is
    available (``pinned`` says which it got); page-locked memory is what lets
    device copies run asynchronously. It is pinned in place with
    ``cudaHostRegister``, exactly its size: torch's ``pin_memory`` allocator
    rounds every request up to a power of two (a 40 GiB pool would lock
    64 GiB), so it is only the fallback. The region is a huge-page mapping
    (``host_memory.host_buffer``). Its contents are not meaningful until a
    store wrote a slot. ``buffer`` (a contiguous uint8 host
    tensor of at least ``nbytes``) is used instead of a fresh allocation,
    e.g. to reuse one committed region across pools; it is then pinned iff
    the buffer is.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        block_size_factor: int = 1,
        pin_memory: bool = True,
        buffer: torch.Tensor | None = None,
    ) -> None:
        for name, value in (("num_slots", num_slots), ("block_size_factor", block_size_factor)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"HostPool {name} must be a positive int, got {value!r}")
        self.layout = layout
        self.num_slots = num_slots
        self.block_size_factor = block_size_factor
        shape = layout.region_shape(self.num_sub_blocks)
        self.region: torch.Tensor | None
        if buffer is None:
            dtype = layout.geometry.dtype
            self.pinned = bool(pin_memory) and torch.cuda.is_available()
            self.region = host_buffer(self.nbytes).view(dtype).view(shape)
            if self.pinned:
                if pin_in_place(self.region):
                    # The finalizer holds the region: it is unpinned before it is freed.
                    weakref.finalize(self, unpin, self.region)
                else:
                    self.region = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            self.pinned = buffer.is_pinned()
            self.region = _adopt(buffer, self.nbytes).view(layout.geometry.dtype).view(shape)
        self.tensors: list[torch.Tensor] = layout.split_region(self.region)
        self.planes: list[torch.Tensor] = layout.block_planes(self.tensors)

    @classmethod
    def over_tensors(
        cls,
        layout: KVLayout,
        tensors: Sequence[torch.Tensor],
        block_size_factor: int = 1,
        pinned: bool = False,
    ) -> HostPool:
        """A pool whose slots are the rows of existing host ``tensors`` (the layout's tensors).

        For memory another party allocated and shares, such as a region
        mapped by several processes (vLLM's shared offload region, one row
        per slot, each rank seeing its own shard of the row). The tensors
        must match ``layout`` for ``num_slots * block_size_factor`` blocks
        (``KVLayout.num_blocks_of``: rows contiguous, blocks may be strided);
        the pool reads and writes them in place and never frees them.
        ``region`` is None for such a pool. ``pinned`` records whether the
        owner page-locked the memory (device copies run asynchronously then).
        """
        if not isinstance(block_size_factor, int) or block_size_factor <= 0:
            raise ValueError(
                f"HostPool block_size_factor must be a positive int, got {block_size_factor!r}"
            )
        tensors = list(tensors)
        num_blocks = layout.num_blocks_of(tensors)
        if tensors[0].device.type != "cpu":
            raise ValueError(f"HostPool tensors must be on the CPU, got {tensors[0].device}")
        if num_blocks == 0 or num_blocks % block_size_factor:
            raise ValueError(
                f"HostPool tensors hold {num_blocks} blocks, not a positive multiple of "
                f"block_size_factor={block_size_factor}"
            )
        pool = cls.__new__(cls)
        pool.layout = layout
        pool.num_slots = num_blocks // block_size_factor
        pool.block_size_factor = block_size_factor
        pool.pinned = pinned
        pool.region = None
        pool.tensors = tensors
        pool.planes = layout.block_planes(tensors)
        return pool

    @classmethod
    def from_budget(
        cls,
        layout: KVLayout,
        budget_bytes: int | str,
        block_size_factor: int = 1,
        pin_memory: bool = True,
    ) -> HostPool:
        """As many slots as fit in ``budget_bytes`` (an int or e.g. "4GiB")."""
        n = num_cpu_blocks(budget_bytes, layout.geometry, block_size_factor)
        return cls(layout, n, block_size_factor, pin_memory)

    def __repr__(self) -> str:
        return (
            f"HostPool(num_slots={self.num_slots}, block_size_factor={self.block_size_factor}, "
            f"kind={self.layout.kind!r}, nbytes={self.nbytes}, pinned={self.pinned})"
        )

    @property
    def num_sub_blocks(self) -> int:
        return self.num_slots * self.block_size_factor

    @property
    def slot_bytes(self) -> int:
        return self.block_size_factor * self.layout.bytes_per_block

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def check_slots(self, slot_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``slot_ids`` as a 1-D int64 array, or ``ValueError`` naming a bad one."""
        ids = np.asarray(slot_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"slot ids must be 1-D, got shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.num_slots)]
        if bad.size:
            raise ValueError(
                f"CPU slot id {int(bad[0])} out of range [0, {self.num_slots})"
                + (f" ({bad.size} bad ids)" if bad.size > 1 else "")
            )
        return ids

    def sub_block_ids(self, slot_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Row indices of the sub-blocks of ``slot_ids``, slot by slot, in order."""
        ids = self.check_slots(slot_ids)
        f = self.block_size_factor
        if f == 1:
            return ids
        return (ids[:, None] * f + np.arange(f, dtype=np.int64)).reshape(-1)

    def read_slots(self, slot_ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """A copy of the slots' bytes, ``[len(slot_ids), slot_bytes]`` uint8.

        Row order within a slot: sub-block, then plane. This is the
        serialised form other tiers (disk, Redis) store; ``write_slots``
        is its inverse.
        """
        rows = torch.from_numpy(self.sub_block_ids(slot_ids))
        n_planes = len(self.planes)
        row_bytes = self.layout.plane_row_bytes
        out = torch.empty((rows.numel(), n_planes, row_bytes), dtype=torch.uint8)
        for p, plane in enumerate(self.planes):
            out[:, p] = plane.index_select(0, rows)
        return out.view(-1, self.slot_bytes)

    def write_slots(self, slot_ids: Sequence[int] | np.ndarray, data: torch.Tensor) -> None:
        """Overwrite the slots with ``data`` as produced by ``read_slots``."""
        ids = self.check_slots(slot_ids)
        if np.unique(ids).size != ids.size:
            raise ValueError("write_slots: slot ids must be distinct")
        rows = torch.from_numpy(self.sub_block_ids(ids))
        n = rows.numel() // self.block_size_factor
        if data.dtype != torch.uint8 or data.numel() != n * self.slot_bytes:
            raise ValueError(
                f"slot data must be {n} x {self.slot_bytes} uint8 bytes, got {data.dtype} "
                f"with {data.numel()} elements"
            )
        src = data.reshape(rows.numel(), len(self.planes), self.layout.plane_row_bytes)
        for p, plane in enumerate(self.planes):
            plane.index_copy_(0, rows, src[:, p])


def _adopt(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    if buffer.device.type != "cpu" or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise ValueError("HostPool buffer must be a contiguous uint8 CPU tensor")
    if buffer.numel() < nbytes:
        raise ValueError(f"HostPool buffer has {buffer.numel()} bytes, the pool needs {nbytes}")
    if buffer.data_ptr() % 64:
        raise ValueError("HostPool buffer must be 64-byte aligned")
    return buffer.view(-1)[:nbytes]
