"""The disk tier's bytes: KV blocks in preallocated slab files, with a persistent index.

Directory layout::

    manifest.json   geometry fingerprint, hash function, block and slot sizes,
                    capacity; written last at creation (atomic rename), so its
                    presence means the slabs and the index exist
    slab-00000.bin  ``blocks_per_file`` slots of ``slot_bytes`` each (block
    slab-00001.bin  bytes rounded up to 4 KiB so that O_DIRECT offsets align)
    index.log       append-only log of fixed-size records: PUT(slot, key,
                    checksum, seq) and DEL(slot); each record carries its own
                    checksum, so a torn tail record is ignored on replay;
                    compacted by writing a snapshot and renaming it over
    .lock           flock'ed while a process has the store open

Invariants:

- An index entry names a slot whose bytes were fully written before the
  entry's PUT record was appended; a slot being overwritten has no entry (the
  in-memory entry is dropped before the write, and its old checksum no longer
  matches should a crash leave the old record in the log).
- Every read verifies the block's xxh3-64 checksum; a mismatch or a short read
  (a truncated slab) is a miss, the entry is dropped (and logged as DEL), and
  the caller's buffer must not be used. A corrupt block is never reported as
  a hit.
- The store never chooses slots or victims: the scheduler side (the disk
  tier's manager) does, and passes slots in. Re-opening a directory hands the
  surviving entries back through ``entries()`` so that manager can rebuild.

I/O runs with O_DIRECT when the filesystem accepts it (probed at open) and
buffered otherwise; runs of consecutive slots are coalesced into one
``preadv``/``pwritev`` and spread over a thread pool (both release the GIL).
The slab files are ``slabs.SlabFiles``; the index log's format is
``index``, the in-memory index over it ``catalog``; the manifest and the
lock are ``manifest``'s; this module keeps the write/read protocol between
them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvoffload.tiers.disk.catalog import INDEX_NAME, DiskCatalog, why_failed, write_alarm
from kvoffload.tiers.disk.index import MAX_KEY_BYTES, DiskEntry, IndexLog
from kvoffload.tiers.disk.manifest import (
    MANIFEST_NAME,
    check_manifest,
    claim_directory,
    manifest_of,
    write_manifest,
)
from kvoffload.tiers.disk.slabs import (
    ALIGN,
    DiskStoreError,
    DiskStoreMismatchError,
    SlabFiles,
    round_up,
)
from kvoffload.transfer.block_buffers import BlockBuffers, as_block_views

logger = logging.getLogger(__name__)

# Batches below this many bytes run on the calling thread (pool overhead dominates).
_INLINE_BYTES = 1 << 20

__all__ = [
    "INDEX_NAME",
    "MANIFEST_NAME",
    "DiskBlockStore",
    "DiskEntry",
    "DiskStoreError",
    "DiskStoreMismatchError",
    "DiskStoreStats",
]


@dataclass
class DiskStoreStats:
    blocks_written: int = 0
    blocks_read: int = 0
    #: Blocks whose slab write failed (they were not stored).
    write_errors: int = 0
    #: Index records the filesystem refused (those blocks are served until a restart loses them).
    index_errors: int = 0
    #: Compactions of the index that could not be written (the log is kept as it was).
    compaction_errors: int = 0
    misses: int = 0
    corrupt_blocks: int = 0
    truncated_blocks: int = 0


class DiskBlockStore:
    """Fixed-size blocks in preallocated slab files under ``directory``.

    ``geometry_fingerprint`` is the tier's identity: everything that decides
    the stored bytes (the model, KV geometry, dtype, quantisation, layout,
    hash function and seed, parallel rank; ``identity.tier_fingerprint``
    builds it). It and ``hash_fn`` are recorded in the manifest; re-opening
    with other values, another ``block_bytes`` or another capacity raises
    ``DiskStoreMismatchError``, whose one-line message names each differing
    field with the directory's value and this engine's. ``direct_io``: None
    probes O_DIRECT and falls back to buffered I/O; True requires it; False
    never uses it. ``durable=True`` fsyncs data before index records (and the
    index after each batch); without it a crash may lose recent entries but,
    thanks to checksums, never returns a torn block.

    A full filesystem (or any write error) never raises from ``put``,
    ``remove`` or ``get_into``: the blocks concerned are not stored (or their
    index records not persisted), ``stats`` counts them, one warning says
    when failures start and one when writes succeed again. Re-opening on a
    full filesystem works: the index is read, a torn tail is cut (which
    needs no space) and compaction waits until there is room.

    Thread-safe: batch calls may come from several threads at once.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        block_bytes: int,
        capacity_blocks: int,
        geometry_fingerprint: str,
        *,
        hash_fn: str = "",
        blocks_per_file: int | None = None,
        direct_io: bool | None = None,
        num_io_threads: int = 4,
        durable: bool = False,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if num_io_threads <= 0:
            raise ValueError(f"num_io_threads must be positive, got {num_io_threads}")
        if blocks_per_file is not None and blocks_per_file <= 0:
            raise ValueError(f"blocks_per_file must be positive, got {blocks_per_file}")
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        self.slot_bytes = round_up(block_bytes, ALIGN)
        self.capacity_blocks = capacity_blocks
        self.blocks_per_file = min(blocks_per_file or capacity_blocks, capacity_blocks)
        self.geometry_fingerprint = geometry_fingerprint
        self.hash_fn = hash_fn
        self.durable = durable
        self.stats = DiskStoreStats()
        self._lock = threading.Lock()
        self._lock_fd = -1
        self._open_catalog: DiskCatalog | None = None
        self._alarm = write_alarm(self.directory)
        self._slabs = SlabFiles(self.directory, block_bytes, capacity_blocks, self.blocks_per_file)
        self._closed = False
        try:
            self._open(direct_io)
        except BaseException:
            self._release()
            raise
        self._pool = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvoffload-disk")

    @property
    def direct_io(self) -> bool:
        """Whether slab I/O runs with O_DIRECT (probed at open)."""
        return self._slabs.direct_io

    # -- opening ------------------------------------------------------------

    def _manifest(self) -> dict[str, Any]:
        return manifest_of(
            self.geometry_fingerprint,
            self.hash_fn,
            self.block_bytes,
            self.slot_bytes,
            self.capacity_blocks,
            self.blocks_per_file,
        )

    def _open(self, direct_io: bool | None) -> None:
        d = self.directory
        self._lock_fd = claim_directory(d)
        fresh = not (d / MANIFEST_NAME).exists()
        if not fresh:
            check_manifest(d, self._manifest())
        try:
            if fresh:
                self._slabs.check_free_space()
            self._slabs.open(direct_io, fresh)
            log = IndexLog(d / INDEX_NAME, self.durable)
            self._open_catalog = DiskCatalog(d, log, self.capacity_blocks, self.stats, self._alarm)
            if fresh:
                if not log.rewrite([]):
                    raise log.last_error or OSError("index rewrite failed")
                write_manifest(d, self._manifest())
            else:
                self._open_catalog.load(self.blocks_per_file, self._slabs.truncated_from)
        except OSError as e:
            raise DiskStoreError(f"disk tier directory {d} is not usable: {e}") from e

    @property
    def _catalog(self) -> DiskCatalog:
        assert self._open_catalog is not None, "the store is not open"
        return self._open_catalog

    # -- index --------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._catalog.by_key)

    def entries(self) -> list[DiskEntry]:
        """Every stored block, oldest write first (the order to rebuild recency in)."""
        with self._lock:
            return sorted(self._catalog.by_key.values(), key=lambda e: e.seq)

    def contains(self, key: bytes, slot: int | None = None) -> bool:
        with self._lock:
            e = self._catalog.by_key.get(bytes(key))
        return e is not None and (slot is None or e.slot == slot)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            by_key = self._catalog.by_key
            return [bytes(k) in by_key for k in keys]

    def slot_of(self, key: bytes) -> int | None:
        with self._lock:
            e = self._catalog.by_key.get(bytes(key))
        return None if e is None else e.slot

    def remove(self, keys: Iterable[bytes]) -> int:
        """Forget ``keys`` (their slots become free to overwrite); returns how many were known."""
        with self._lock:
            records = self._catalog.forget(bytes(k) for k in keys)
            self._catalog.append(records)
            return len(records)

    def clear(self) -> None:
        """Forget every block (the slabs keep their bytes; nothing is reachable any more)."""
        with self._lock:
            self._catalog.clear()  # needs no free space, unlike a rewrite

    # -- I/O plumbing -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DiskStoreError(f"disk tier {self.directory} is closed")

    def _fan_out(self, work: list[Any], fn: Any, nbytes: int) -> list[Any]:
        if len(work) <= 1 or nbytes < _INLINE_BYTES:
            return [fn(w) for w in work]
        futures = [self._pool.submit(fn, w) for w in work]
        return [fut.result() for fut in futures]

    # -- batch writes -------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: BlockBuffers, slots: Sequence[int]) -> list[bool]:
        """Write ``blocks[i]`` as ``keys[i]`` at ``slots[i]``; per block, whether it was stored.

        Whatever ``slots[i]`` held before is dropped, and so is any other slot
        holding ``keys[i]``. A failed write (I/O error) leaves the slot empty.
        """
        self._check_open()
        keys = [bytes(k) for k in keys]
        slots = [int(s) for s in slots]
        n = len(keys)
        if len(slots) != n:
            raise ValueError(f"{n} keys but {len(slots)} slots")
        if len(set(slots)) != n:
            raise ValueError("slots of one put must be distinct")
        for k in keys:
            if len(k) > MAX_KEY_BYTES:
                raise ValueError(f"keys have at most {MAX_KEY_BYTES} bytes, got {len(k)}")
        for s in slots:
            if not 0 <= s < self.capacity_blocks:
                raise ValueError(f"slot {s} out of range [0, {self.capacity_blocks})")
        views = as_block_views(blocks, n, self.block_bytes)
        if n == 0:
            return []
        checksums = [xxhash.xxh3_64_intdigest(v.data) for v in views]
        with self._lock:
            self._catalog.append(self._catalog.vacate(keys, slots), healthy=False)

        def write(run: list[int]) -> OSError | None:
            try:
                self._slabs.write_run(slots[run[0]], [views[i] for i in run])
                return None
            except OSError as e:
                return e

        runs = self._slabs.runs(slots)
        errs = self._fan_out(runs, write, n * self.slot_bytes)
        ok = [False] * n
        for run, err in zip(runs, errs):
            for i in run:
                ok[i] = err is None
        first_err = next((e for e in errs if e is not None), None)
        if self.durable and first_err is None:
            try:
                self._slabs.sync()
            except OSError as e:
                first_err = e
                ok = [False] * n
        with self._lock:
            records = []
            for i in range(n):
                if not ok[i]:
                    continue
                record = self._catalog.add(keys[i], slots[i], checksums[i])
                if record is None:
                    ok[i] = False
                    continue
                records.append(record)
            failed = n - len(records)
            self.stats.blocks_written += len(records)
            self.stats.write_errors += failed
            if first_err is not None:
                self._alarm.failed(first_err, why=why_failed(first_err), blocks=failed)
            self._catalog.append(records, healthy=first_err is None)
        return ok

    # -- batch reads --------------------------------------------------------

    def get_into(
        self,
        keys: Sequence[bytes],
        out: BlockBuffers,
        slots: Sequence[int] | None = None,
    ) -> list[bool]:
        """Read ``keys[i]`` into ``out[i]``; per block, whether it is a verified hit.

        With ``slots``, a key stored at another slot is a miss. A block whose
        checksum fails or that lies past the end of a truncated slab is a miss
        and its entry is dropped. ``out[i]`` holds garbage on a miss.
        """
        self._check_open()
        keys = [bytes(k) for k in keys]
        n = len(keys)
        if slots is not None and len(slots) != n:
            raise ValueError(f"{n} keys but {len(slots)} slots")
        views = as_block_views(out, n, self.block_bytes, writable=True)
        hit = [False] * n
        found: list[int] = []
        entries: dict[int, DiskEntry] = {}
        with self._lock:
            for i, k in enumerate(keys):
                e = self._catalog.by_key.get(k)
                if e is not None and (slots is None or e.slot == int(slots[i])):
                    entries[i] = e
                    found.append(i)
        if not found:
            self.stats.misses += n
            return hit
        found_slots = [entries[i].slot for i in found]
        if len(set(found_slots)) != len(found_slots):
            raise ValueError("keys of one get must be distinct")
        runs = self._slabs.runs(found_slots)

        def read(run: list[int]) -> tuple[list[int], int, str]:
            idx = [found[j] for j in run]
            try:
                return idx, self._slabs.read_run(found_slots[run[0]], [views[i] for i in idx]), ""
            except OSError as e:
                return idx, 0, str(e)

        bad: list[tuple[DiskEntry, str]] = []
        for idx, whole, err in self._fan_out(runs, read, len(found) * self.slot_bytes):
            for pos, i in enumerate(idx):
                e = entries[i]
                if pos >= whole:
                    bad.append((e, err or "truncated"))
                elif xxhash.xxh3_64_intdigest(views[i].data) != e.checksum:
                    bad.append((e, "checksum mismatch"))
                else:
                    hit[i] = True
        with self._lock:
            for e, why in bad:
                if why == "checksum mismatch":
                    self.stats.corrupt_blocks += 1
                elif why == "truncated":
                    self.stats.truncated_blocks += 1
                self._catalog.drop_if_current(e)
            self.stats.blocks_read += sum(hit)
            self.stats.misses += n - sum(hit)
        if bad:
            logger.warning(
                "disk tier %s: dropped %d unreadable blocks (%s)",
                self.directory,
                len(bad),
                ", ".join(sorted({why for _, why in bad})),
            )
        return hit

    def get(
        self, keys: Sequence[bytes], slots: Sequence[int] | None = None
    ) -> list[np.ndarray | None]:
        """Like ``get_into`` into fresh arrays; None for a miss."""
        out = np.empty((len(keys), self.block_bytes), dtype=np.uint8)
        hit = self.get_into(keys, out, slots)
        return [out[i] if h else None for i, h in enumerate(hit)]

    # -- closing ------------------------------------------------------------

    def flush(self) -> None:
        """Make everything written so far durable (data, then index)."""
        self._slabs.sync()
        with self._lock:
            if self._open_catalog is not None:
                self._open_catalog.log.sync()

    def _release(self) -> None:
        self._slabs.close()
        if self._open_catalog is not None:
            self._open_catalog.log.close()
            self._open_catalog = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # also drops the flock
            self._lock_fd = -1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            self.flush()
        except OSError as e:
            # Closing must not fail on a full disk: checksums guard whatever did not land.
            logger.warning("disk tier %s: final flush failed: %s", self.directory, e)
        finally:
            self._alarm.report_at_close()
            self._release()

    def __enter__(self) -> DiskBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DiskBlockStore({str(self.directory)!r}, block_bytes={self.block_bytes}, "
            f"capacity_blocks={self.capacity_blocks}, direct_io={self.direct_io})"
        )
