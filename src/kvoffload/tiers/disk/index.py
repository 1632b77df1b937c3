"""The disk tier's persistent index: ``index.log``, an append-only log of fixed-size records.

Records are PUT(slot, key, checksum, seq) and DEL(slot), each ``RECORD_BYTES``
long and carrying its own xxh32, so a damaged record is skipped on replay and
a torn tail is ignored. The log is compacted by writing a snapshot to a
temporary file and renaming it over.

Invariants:

- The file's length is a whole number of records whenever no append is in
  flight: an append that fails part way (a full filesystem) is cut back to
  the last whole record, and a torn tail found at open is cut off, so later
  appends stay aligned. Cutting a file shorter needs no free space.
- Nothing here raises on a full filesystem during normal operation: a failed
  append or compaction is reported to the caller (False) and the log is left
  as it was; the store decides what that means (its in-memory index stays
  right; only durability across a restart is lost).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

MAX_KEY_BYTES = 64

OP_PUT = 1
OP_DEL = 2
_REC_MAGIC = b"KVIX"
# magic, op, key_len, pad, slot, seq, checksum, key, record checksum
_RECORD = struct.Struct("<4sBBHIQQ64sI")
RECORD_BYTES = _RECORD.size
_REC_BODY = _RECORD.size - 4


@dataclass(frozen=True)
class DiskEntry:
    """One stored block: ``key`` at ``slot``, with its checksum and write sequence."""

    key: bytes
    slot: int
    checksum: int
    seq: int


def make_record(op: int, slot: int, seq: int = 0, checksum: int = 0, key: bytes = b"") -> bytes:
    body = _RECORD.pack(_REC_MAGIC, op, len(key), 0, slot, seq, checksum, key, 0)[:_REC_BODY]
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body))


def put_record(e: DiskEntry) -> bytes:
    return make_record(OP_PUT, e.slot, e.seq, e.checksum, e.key)


def del_record(slot: int) -> bytes:
    return make_record(OP_DEL, slot)


def parse_record(rec: bytes) -> tuple[int, int, int, int, bytes] | None:
    if len(rec) != _RECORD.size:
        return None
    magic, op, key_len, _, slot, seq, checksum, key, crc = _RECORD.unpack(rec)
    if magic != _REC_MAGIC or crc != xxhash.xxh32_intdigest(rec[:_REC_BODY]):
        return None
    if op not in (OP_PUT, OP_DEL) or key_len > MAX_KEY_BYTES:
        return None
    return op, slot, seq, checksum, key[:key_len]


def is_no_space(err: BaseException) -> bool:
    """Whether ``err`` says the filesystem (or quota) is full."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class IndexLog:
    """The append-only index file; the caller serialises every call.

    ``append`` and ``rewrite`` return False (with ``last_error`` set) instead
    of raising when the filesystem refuses them; the file is then as it was.
    """

    def __init__(self, path: Path, durable: bool) -> None:
        self.path = path
        self.durable = durable
        self.num_records = 0
        self.last_error: OSError | None = None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def replay(self) -> tuple[dict[int, DiskEntry], int]:
        """Live entries by slot, and how many damaged records were skipped.

        A torn tail record is counted as damaged and cut off (no space needed).
        """
        with open(self.path, "rb") as f:
            data = f.read()
        entries: dict[int, DiskEntry] = {}
        bad = 0
        n = len(data) // _RECORD.size
        for i in range(n):
            parsed = parse_record(data[i * _RECORD.size : (i + 1) * _RECORD.size])
            if parsed is None:
                # Skipping a damaged DEL may resurrect an older PUT; that block's
                # checksum then fails on read (its slot was rewritten), so it is
                # still never returned.
                bad += 1
                continue
            op, slot, seq, checksum, key = parsed
            if op == OP_PUT:
                entries[slot] = DiskEntry(key, slot, checksum, seq)
            else:
                entries.pop(slot, None)
        if len(data) % _RECORD.size:
            bad += 1
            os.ftruncate(self._fd, n * _RECORD.size)
        self._size = n * _RECORD.size
        self.num_records = n
        return entries, bad

    def append(self, records: Sequence[bytes]) -> bool:
        """Append ``records``; False (file unchanged) when the filesystem refuses."""
        if not records:
            return True
        buf = b"".join(records)
        view = memoryview(buf)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            if self.durable:
                os.fsync(self._fd)
        except OSError as e:
            self.last_error = e
            self._cut_back()
            return False
        self._size += len(buf)
        self.num_records += len(records)
        return True

    def _cut_back(self) -> None:
        # A partial append would misalign every later record: drop it.
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)

    def rewrite(self, entries: Iterable[DiskEntry]) -> bool:
        """Replace the log by a snapshot of ``entries`` (temp file + rename); False if refused."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        buf = b"".join(put_record(e) for e in entries)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(buf)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as e:
            self.last_error = e
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return False
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        self._size = len(buf)
        self.num_records = len(buf) // _RECORD.size
        return True

    def truncate(self) -> None:
        """Empty the log in place (needs no free space)."""
        os.ftruncate(self._fd, 0)
        self._size = 0
        self.num_records = 0
        try:
            os.fsync(self._fd)
        except OSError as e:
            self.last_error = e

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
