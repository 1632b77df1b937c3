"""Byte views of block buffers handed to the block stores.

The disk and Redis stores read into and write from memory the caller owns
(host pool slots, numpy arrays, torch CPU tensors), so that a block crosses
at most one copy between a tier and the host pool. Everything is turned into
1-D contiguous ``numpy.uint8`` views here; a view shares memory with the
caller's buffer, never copies it.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: What a batch call accepts: one ``[n, block_bytes]`` array or tensor (row i is
#: block i), or a sequence of n buffers of ``block_bytes`` bytes each.
BlockBuffers = np.ndarray | torch.Tensor | Sequence[Any]


def _one_view(buf: Any, block_bytes: int, writable: bool) -> np.ndarray:
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"block buffers must be CPU memory, got a tensor on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("block buffers must be contiguous")
        arr = buf.detach().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("block buffers must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.nbytes != block_bytes:
        raise ValueError(f"a block buffer has {arr.nbytes} bytes, expected {block_bytes}")
    if writable and not arr.flags.writeable:
        raise ValueError("block buffers to read into must be writable")
    return arr


def as_block_views(
    buffers: BlockBuffers, n: int, block_bytes: int, writable: bool = False
) -> list[np.ndarray]:
    """``n`` uint8 views of ``block_bytes`` each, sharing memory with ``buffers``.

    A 2-D array or tensor must have ``n`` rows of ``block_bytes`` bytes; a
    sequence must have ``n`` items. Wrong sizes, non-contiguous or non-CPU
    memory, and read-only memory where ``writable`` is asked are ``ValueError``.
    """
    if isinstance(buffers, (np.ndarray, torch.Tensor)) and buffers.ndim >= 2:
        if buffers.shape[0] != n:
            raise ValueError(f"expected {n} blocks, got an array of {buffers.shape[0]} rows")
        return [_one_view(buffers[i], block_bytes, writable) for i in range(n)]
    if isinstance(buffers, (np.ndarray, torch.Tensor)):
        if n != 1:
            raise ValueError(f"expected {n} blocks, got one 1-D buffer")
        return [_one_view(buffers, block_bytes, writable)]
    items = list(buffers)
    if len(items) != n:
        raise ValueError(f"expected {n} block buffers, got {len(items)}")
    return [_one_view(b, block_bytes, writable) for b in items]


def aligned_empty(nbytes: int, align: int = mmap.PAGESIZE) -> np.ndarray:
    """A zeroed uint8 array whose address is a multiple of ``align`` (O_DIRECT bounce buffers).

    ``align`` must divide the page size: anonymous mmaps are page-aligned.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    if mmap.PAGESIZE % align:
        raise ValueError(f"align {align} must divide the page size {mmap.PAGESIZE}")
    mem = mmap.mmap(-1, nbytes)
    # The array keeps the mmap alive through its base.
    return np.frombuffer(mem, dtype=np.uint8)


def address_of(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)
