"""The disk tier's slab files: preallocation, O_DIRECT probing and vectored slot I/O.

Slot ``s`` lives in file ``s // blocks_per_file`` at offset
``(s % blocks_per_file) * slot_bytes``; ``slot_bytes`` is the block size
rounded up to 4 KiB so that O_DIRECT offsets align. Runs of consecutive
slots in one file move in one ``preadv``/``pwritev`` (short transfers
continue). Nothing here knows keys, checksums or the index: ``DiskBlockStore``
does.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.tiers.disk.index import is_no_space
from kvoffload.transfer.block_buffers import address_of, aligned_empty

logger = logging.getLogger(__name__)

ALIGN = 4096
# Bound on one preadv/pwritev: iovec count and bytes.
_MAX_RUN_IOV = 512
_MAX_RUN_BYTES = 4 << 20


class DiskStoreError(RuntimeError):
    """The disk tier cannot be used as configured (bad directory, no space, in use)."""


class DiskStoreMismatchError(DiskStoreError):
    """The directory holds a disk tier written by another model or an incompatible engine."""


def _skip(iov: list[Any], done: int) -> list[Any]:
    """What is left of ``iov`` once its first ``done`` bytes moved (after a short I/O call)."""
    while iov and done >= len(iov[0]):
        done -= len(iov[0])
        iov = iov[1:]
    if iov and done:
        iov = [memoryview(iov[0])[done:], *iov[1:]]
    return iov


def _write_all(fd: int, iov: list[Any], offset: int) -> None:
    """``pwritev`` until every byte of ``iov`` is written (short writes continue)."""
    while iov:
        done = os.pwritev(fd, iov, offset)
        offset += done
        iov = _skip(iov, done)


def _read_all(fd: int, iov: list[Any], offset: int) -> int:
    """``preadv`` until ``iov`` is full or end of file; returns the bytes read."""
    total = 0
    while iov:
        done = os.preadv(fd, iov, offset)
        if done == 0:
            break
        total += done
        offset += done
        iov = _skip(iov, done)
    return total


def round_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


class SlabFiles:
    """The ``slab-NNNNN.bin`` files of one directory, open for slot I/O.

    ``open`` creates (``fresh``) or re-opens them; a re-opened slab shorter
    than its slots is extended and its lost slots are listed in
    ``truncated_from`` (file -> first lost local slot). I/O errors propagate
    as ``OSError``; configuration errors are ``DiskStoreError``.
    """

    def __init__(
        self, directory: Path, block_bytes: int, capacity_blocks: int, blocks_per_file: int
    ) -> None:
        self.directory = directory
        self.block_bytes = block_bytes
        self.slot_bytes = round_up(block_bytes, ALIGN)
        self.capacity_blocks = capacity_blocks
        self.blocks_per_file = blocks_per_file
        self.direct_io = False
        self.truncated_from: dict[int, int] = {}
        self.fds: list[int] = []
        self._tls = threading.local()
        self._pad = np.zeros(self.slot_bytes - block_bytes, dtype=np.uint8)

    def num_files(self) -> int:
        return -(-self.capacity_blocks // self.blocks_per_file)

    def file_blocks(self, i: int) -> int:
        return min(self.blocks_per_file, self.capacity_blocks - i * self.blocks_per_file)

    def path(self, i: int) -> Path:
        return self.directory / f"slab-{i:05d}.bin"

    def check_free_space(self) -> None:
        need = self.capacity_blocks * self.slot_bytes
        have = sum(
            p.stat().st_size for i in range(self.num_files()) if (p := self.path(i)).exists()
        )
        free = shutil.disk_usage(self.directory).free
        if need - have > free:
            raise DiskStoreError(
                f"not enough free space in {self.directory} for {self.capacity_blocks} "
                f"blocks ({need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free)"
            )

    def open(self, direct_io: bool | None, fresh: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT
        use_direct = direct_io is not False and hasattr(os, "O_DIRECT")
        self.truncated_from = {}
        for i in range(self.num_files()):
            path = self.path(i)
            size = self.file_blocks(i) * self.slot_bytes
            fd = os.open(path, flags | (os.O_TRUNC if fresh else 0), 0o644)
            try:
                have = os.fstat(fd).st_size
                if have < size:
                    if not fresh:
                        # Slots past the end were lost; their entries are dropped on load.
                        self.truncated_from[i] = have // self.slot_bytes
                    self._preallocate(fd, have, size, fresh)
            finally:
                os.close(fd)
        self.direct_io = False
        if use_direct:
            self.direct_io = self._probe_direct()
            if direct_io and not self.direct_io:
                raise DiskStoreError(
                    f"O_DIRECT was required but the filesystem of {self.directory} refuses it"
                )
        extra = os.O_DIRECT if self.direct_io else 0
        self.fds = [os.open(self.path(i), os.O_RDWR | extra) for i in range(self.num_files())]

    def _preallocate(self, fd: int, have: int, size: int, fresh: bool) -> None:
        try:
            os.posix_fallocate(fd, have, size - have)
        except OSError as e:
            if is_no_space(e) and fresh:
                raise DiskStoreError(
                    f"not enough free space in {self.directory} for the disk tier's slabs"
                ) from e
            if is_no_space(e):
                # A re-opened slab that lost its tail, on a full filesystem: extend it
                # sparse; writes into the hole fail (and are counted) until room returns.
                logger.warning(
                    "disk tier %s: no space to re-allocate a truncated slab; its lost "
                    "slots stay unallocated until room returns",
                    self.directory,
                )
            # Filesystems without fallocate get a sparse file.
            os.ftruncate(fd, size)

    def _probe_direct(self) -> bool:
        try:
            fd = os.open(self.path(0), os.O_RDWR | os.O_DIRECT)
        except OSError:
            return False
        try:
            buf = aligned_empty(ALIGN)
            return os.preadv(fd, [buf.data], 0) == ALIGN
        except OSError:
            return False
        finally:
            os.close(fd)

    def _bounce(self, nbytes: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._tls, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(round_up(nbytes, ALIGN))
            self._tls.buf = buf
        return buf[:nbytes]

    def _scratch_pad(self) -> np.ndarray:
        pad: np.ndarray | None = getattr(self._tls, "pad", None)
        if pad is None:
            pad = np.empty(self.slot_bytes - self.block_bytes, dtype=np.uint8)
            self._tls.pad = pad
        return pad

    def runs(self, slots: Sequence[int]) -> list[list[int]]:
        """Indices into ``slots`` grouped into runs of consecutive slots in one file."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        max_run = max(1, min(_MAX_RUN_IOV, _MAX_RUN_BYTES // self.slot_bytes))
        runs: list[list[int]] = []
        bpf = self.blocks_per_file
        for i in order:
            s = slots[i]
            if runs:
                last = runs[-1]
                prev = slots[last[-1]]
                if s == prev + 1 and s // bpf == prev // bpf and len(last) < max_run:
                    last.append(i)
                    continue
            runs.append([i])
        return runs

    def _direct_ok(self, views: Sequence[np.ndarray]) -> bool:
        if self.slot_bytes != self.block_bytes:
            return False
        return all(address_of(v) % ALIGN == 0 for v in views)

    def write_run(self, slot0: int, views: list[np.ndarray]) -> None:
        f, local = divmod(slot0, self.blocks_per_file)
        fd, offset = self.fds[f], local * self.slot_bytes
        iov: list[Any]
        if self.direct_io and not self._direct_ok(views):
            buf = self._bounce(len(views) * self.slot_bytes)
            rows = buf.reshape(len(views), self.slot_bytes)
            for row, v in zip(rows, views):
                row[: self.block_bytes] = v
                row[self.block_bytes :] = 0
            iov = [buf]
        elif self.slot_bytes != self.block_bytes:
            iov = [x for v in views for x in (v, self._pad)]
        else:
            iov = list(views)
        _write_all(fd, iov, offset)

    def read_run(self, slot0: int, views: list[np.ndarray]) -> int:
        """Read consecutive slots into ``views``; returns how many blocks were read whole."""
        f, local = divmod(slot0, self.blocks_per_file)
        fd, offset = self.fds[f], local * self.slot_bytes
        n = len(views)
        if self.direct_io and not self._direct_ok(views):
            buf = self._bounce(n * self.slot_bytes)
            got = _read_all(fd, [buf], offset)
            rows = buf.reshape(n, self.slot_bytes)
            whole = min(n, got // self.slot_bytes)
            for row, v in zip(rows[:whole], views):
                v[:] = row[: self.block_bytes]
            return whole
        if self.slot_bytes != self.block_bytes:
            pad = self._scratch_pad()
            got = _read_all(fd, [x for v in views for x in (v, pad)], offset)
            # The last block needs its bytes, not its padding.
            whole = got // self.slot_bytes
            if whole < n and got - whole * self.slot_bytes >= self.block_bytes:
                whole += 1
            return whole
        got = _read_all(fd, list(views), offset)
        return got // self.slot_bytes

    def sync(self) -> None:
        for fd in self.fds:
            os.fdatasync(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
