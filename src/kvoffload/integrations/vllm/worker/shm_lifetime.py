"""The CPU tier's shared region in ``/dev/shm`` never outlives its engine.

With lower tiers, kvoffload's CPU tier lives in vLLM's ``SharedOffloadRegion``
(``/dev/shm/vllm_offload_<engine id>.mmap``, the size of ``cpu_bytes``): each
worker maps its shard at start-up, then the scheduler maps it whole. vLLM
removes the name only from the process that created the file, at a clean
shutdown; a force-killed engine core (vLLM's own shutdown path does that) or
a SIGKILL left the file, and its RAM, behind.

Here the name is removed as soon as every process of the engine has mapped
the file: a mapping stays valid after its file is unlinked, so the memory
lives exactly as long as the last process that maps it, however it exits.
The protocol (``open_shared_region``):

1. **A lease** per mapping process (``RegionLease``): an fd of the file that
   holds a shared ``flock`` for as long as the process maps it. A file whose
   lock nobody holds belongs to no live process.
2. **Create published locked**: the first process creates the file unnamed
   (``O_TMPFILE``), sizes it, writes a header page *after* vLLM's rows (magic,
   expected number of mapping processes, region bytes), takes its shared lock
   and only then links the name in; a racing peer's link fails with EEXIST
   and it joins instead. There is no instant at which the name exists
   unlocked, so a peer never mistakes a starting engine's file for a stale one.
   (Without ``O_TMPFILE`` or ``/proc``, a locked scratch file is hard-linked
   to the name instead; a scratch file left by a killed process is swept.)
   vLLM's ``SharedOffloadRegion`` then finds the file and maps it as a joiner
   (it never becomes the file's "creator", so it never unlinks it itself).
3. **Arrive**: after mapping, each process sets its byte in the header (role
   0: the scheduler, ``1 + rank``: a worker) under a byte-range lock of the
   header (open-file-description locks: per fd, so two roles in one process,
   vLLM's uniproc executor, exclude each other too). The process that finds
   every byte set unlinks the name (if the name still names this file).
4. **Stale files**: a process that finds the name taken by a file whose lock
   nobody holds removes it (a dead engine with the same engine id), and once
   per process every ``vllm_offload_*.mmap`` with kvoffload's header and no
   lock holder (a dead engine's, stopped during its start-up) is removed,
   each with one warning line. Files without the header (vLLM's own CPU tier
   regions, which take no lock) are never touched, except at this engine's own
   path.
5. **Release** (the region's ``cleanup``, a clean exit): the lease's lock is
   dropped; a process that was the last holder of a file that is still named
   (a start-up that failed before everyone arrived) removes the name.

Left alone: a process that maps the region after the name is gone would
create a fresh file of its own and not share the engine's memory. None does
in vLLM 0.32 / 0.33: every worker maps during KV-cache registration, which
vLLM finishes on all workers before it builds the scheduler, the last to map.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import mmap
import os
import secrets
import struct
from typing import Any

from kvoffload.integrations.vllm import log_bridge
from kvoffload.integrations.vllm.protocols import SharedRegionView
from kvoffload.transfer import format_bytes

log_bridge.install()

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload.shm")

SHM_DIR = "/dev/shm"
PREFIX = "vllm_offload_"
#: Identifies a region made by this module (first bytes of the header page).
MAGIC = b"kvoffload-shm-v1"
#: Header page: magic, expected roles (u64), region bytes (u64), then one byte per role.
_HEADER = struct.Struct("<16sQQ")
_MARKS_AT = 64
HEADER_BYTES = mmap.PAGESIZE
MAX_ROLES = HEADER_BYTES - _MARKS_AT

_swept = False
#: Whether to make regions unnamed (``O_TMPFILE``); off, or unsupported: a scratch name.
_USE_TMPFILE = True
#: What ``O_TMPFILE`` / ``linkat`` through ``/proc`` fail with where they are not available.
_NO_TMPFILE = frozenset(
    {
        errno.EOPNOTSUPP,
        errno.EISDIR,
        errno.EINVAL,
        errno.ENOENT,
        errno.EXDEV,
        errno.EPERM,
        errno.EACCES,
    }
)
#: The suffix of a scratch file (``_publish_via_scratch``).
MAKING = ".making"


class SharedRegionError(RuntimeError):
    """The shared region cannot be opened as this engine needs it; the message is one line."""


def region_path(engine_id: str) -> str:
    """vLLM's path of an engine's region (``SharedOffloadRegion.mmap_path``)."""
    return os.path.join(SHM_DIR, f"{PREFIX}{engine_id}.mmap")


def role_of(rank: int | None) -> int:
    """The header byte of a mapping process: 0 for the scheduler, ``1 + rank`` for a worker."""
    return 0 if rank is None else 1 + rank


# -- locks ---------------------------------------------------------------------------


def _try_exclusive(fd: int) -> bool:
    """Whether no other lease holds this file (a non-blocking exclusive flock succeeded)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _header_lock(fd: int, header_at: int) -> Any:
    """An open-file-description write lock on the header page (per fd, not per process)."""

    def lock(kind: int) -> None:
        # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
        fcntl.fcntl(
            fd, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", kind, 0, header_at, HEADER_BYTES, 0)
        )

    lock(fcntl.F_WRLCK)
    try:
        yield
    finally:
        lock(fcntl.F_UNLCK)


def _names_this_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_header(fd: int) -> tuple[int, int, int] | None:
    """(header offset, expected roles, region bytes) of a kvoffload region, else None."""
    size = os.fstat(fd).st_size
    if size < HEADER_BYTES or size % HEADER_BYTES:
        return None
    at = size - HEADER_BYTES
    magic, expected, region_bytes = _HEADER.unpack(os.pread(fd, _HEADER.size, at))
    if magic != MAGIC or region_bytes != at or not 0 < expected <= MAX_ROLES:
        return None
    return at, expected, region_bytes


def _remove_stale(fd: int, path: str, why: str) -> bool:
    """Unlink ``path`` (whose file ``fd`` holds exclusively) with one warning line."""
    if not _names_this_file(fd, path):
        return False
    size = os.fstat(fd).st_size
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    logger.warning(
        "kvoffload: removed %s (%s), the CPU-tier region of %s", path, format_bytes(size), why
    )
    return True


# -- stale regions of dead engines ---------------------------------------------------


def sweep_stale_regions(skip: str | None = None) -> int:
    """Remove every kvoffload region in ``/dev/shm`` that no live process holds.

    Only files with kvoffload's header are candidates (vLLM's own regions take
    no lock, so "unlocked" says nothing about them). Returns how many went.
    """
    removed = 0
    regions = glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*.mmap"))
    scratch = glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*.mmap.*{MAKING}"))
    for path in regions + scratch:
        if path == skip:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, another user's, or a link
        try:
            # A scratch name is only ever kvoffload's: no header needed (it may die first).
            ours = path.endswith(MAKING) or _read_header(fd) is not None
            if ours and _try_exclusive(fd):
                removed += _remove_stale(fd, path, "an engine that is gone")
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# -- the lease -----------------------------------------------------------------------


class RegionLease:
    """One process's hold on an engine's region file (module docstring, steps 1-5).

    Invariant: while the lease is open its fd holds a shared flock on the file;
    ``complete`` is True once this lease saw every role arrive (the name was
    removed then, by this process or another).
    """

    def __init__(self, path: str, fd: int, header_at: int, expected: int, created: bool) -> None:
        self.path = path
        self.fd: int | None = fd
        self.header_at = header_at
        self.expected = expected
        self.created = created
        self.complete = False

    @classmethod
    def acquire(cls, path: str, region_bytes: int, expected: int) -> RegionLease:
        """Create the region file at ``path`` (published locked) or join the live one there."""
        global _swept
        if not 0 < expected <= MAX_ROLES:
            raise SharedRegionError(
                f"kvoffload: a shared CPU-tier region serves 1 to {MAX_ROLES} processes, "
                f"not {expected}"
            )
        if region_bytes <= 0 or region_bytes % HEADER_BYTES:
            raise SharedRegionError(f"kvoffload: bad shared region size {region_bytes}")
        if not _swept:
            _swept = True
            sweep_stale_regions(skip=path)
        for _ in range(1000):
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                published = _publish(path, region_bytes, expected)
                if published is None:
                    continue  # a peer published first: join it
                return cls(path, published, region_bytes, expected, created=True)
            lease = cls._join(path, fd, region_bytes, expected)
            if lease is not None:
                return lease
        raise SharedRegionError(f"kvoffload: could not open {path}: it keeps changing")

    @classmethod
    def _join(cls, path: str, fd: int, region_bytes: int, expected: int) -> RegionLease | None:
        """Hold the file ``fd`` opened at ``path``, or None to try again (it went stale)."""
        try:
            if _try_exclusive(fd):
                # Nobody holds it: a dead engine's file under this engine's id.
                _remove_stale(fd, path, "a dead engine with this engine id")
                os.close(fd)
                return None
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0 or not _names_this_file(fd, path):
                os.close(fd)
                return None  # removed (stale) or completed meanwhile: look again
            header = _read_header(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        if header is None or header[1:] != (expected, region_bytes):
            os.close(fd)
            found = (
                "no kvoffload header"
                if header is None
                else (f"{header[1]} processes, {header[2]} bytes")
            )
            raise SharedRegionError(
                f"kvoffload: {path} is in use by a live engine with another layout ({found}; "
                f"this one needs {expected} processes, {region_bytes} bytes): give each engine "
                f"its own engine_id"
            )
        return cls(path, fd, region_bytes, expected, created=False)

    def arrive(self, role: int) -> bool:
        """Mark ``role`` as mapped; the process that completes the set removes the name."""
        assert self.fd is not None, "lease released"
        if not 0 <= role < self.expected:
            logger.warning(
                "kvoffload: %s: role %d outside the %d expected; its name stays until shutdown",
                self.path,
                role,
                self.expected,
            )
            return False
        marks_at = self.header_at + _MARKS_AT
        with _header_lock(self.fd, self.header_at):
            os.pwrite(self.fd, b"\x01", marks_at + role)
            marks = os.pread(self.fd, self.expected, marks_at)
            self.complete = all(marks)
            if self.complete and _names_this_file(self.fd, self.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                logger.info(
                    "kvoffload: all %d processes mapped %s; its name is removed (the memory "
                    "is freed when the last of them exits, however it exits)",
                    self.expected,
                    self.path,
                )
        return self.complete

    def release(self) -> None:
        """Drop the lock; the last holder of a still-named file removes the name."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _names_this_file(fd, self.path) and _try_exclusive(fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                logger.info("kvoffload: removed %s (its last process stopped)", self.path)
        except OSError:
            logger.warning("kvoffload: could not check %s at shutdown", self.path, exc_info=True)
        finally:
            os.close(fd)


def _publish(path: str, region_bytes: int, expected: int) -> int | None:
    """A new region file at ``path``, already locked; None when a peer's took the name."""
    _check_free_space(region_bytes + HEADER_BYTES)
    try:
        if _USE_TMPFILE:
            try:
                return _publish_unnamed(path, region_bytes, expected)
            except OSError as exc:
                if exc.errno not in _NO_TMPFILE:
                    raise
        return _publish_via_scratch(path, region_bytes, expected)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedRegionError(
                f"kvoffload: no room for the CPU tier's {format_bytes(region_bytes)} in "
                f"{os.path.dirname(path)}: {exc.strerror}"
            ) from None
        raise


def _prepare(fd: int, region_bytes: int, expected: int) -> None:
    """Size a new file, write its header page after the rows, and take its shared lock."""
    os.ftruncate(fd, region_bytes + HEADER_BYTES)
    os.pwrite(fd, _HEADER.pack(MAGIC, expected, region_bytes), region_bytes)
    fcntl.flock(fd, fcntl.LOCK_SH)


def _publish_unnamed(path: str, region_bytes: int, expected: int) -> int | None:
    """``O_TMPFILE``, then ``linkat`` through ``/proc``: the name never exists unlocked."""
    directory = os.path.dirname(path)
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        _prepare(fd, region_bytes, expected)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(
                f"/proc/self/fd/{fd}",
                os.path.basename(path),
                dst_dir_fd=dir_fd,
                # linkat(AT_SYMLINK_FOLLOW): link the file /proc names, not the link.
                follow_symlinks=True,
            )
        finally:
            os.close(dir_fd)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _publish_via_scratch(path: str, region_bytes: int, expected: int) -> int | None:
    """Without ``O_TMPFILE`` or ``/proc``: a locked scratch file, hard-linked to ``path``.

    The scratch name (``<path>.<pid>.<random>.making``) lives for microseconds; one
    left by a process killed in between is unlocked, and the sweep removes it.
    """
    scratch = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{MAKING}"
    fd = os.open(scratch, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        _prepare(fd, region_bytes, expected)
        os.link(scratch, path)
    except (FileExistsError, FileNotFoundError):
        # A peer published first, or a sweep took the scratch file before its lock.
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
    return fd


def _check_free_space(nbytes: int) -> None:
    """vLLM's check that ``/dev/shm`` can hold the region (its creator path runs it)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import check_shm_free_space
    except ImportError:  # pragma: no cover - both supported releases have it
        return
    check_shm_free_space(nbytes, allocation_name="CPU KV offload shared region in /dev/shm")


def open_shared_region(
    engine_id: str,
    num_chunks: int,
    rank: int | None,
    kv_bytes_per_chunk: int,
    cpu_page_size: int,
    *,
    world_size: int,
) -> SharedRegionView:
    """vLLM's ``SharedOffloadRegion`` for ``rank`` (None: the scheduler), under a lease.

    ``world_size`` workers and one scheduler map the region; once all have, its
    name is gone. The region's ``cleanup`` also releases the lease.
    """
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    path = region_path(engine_id)
    lease = RegionLease.acquire(path, num_chunks * kv_bytes_per_chunk, world_size + 1)
    try:
        region = SharedOffloadRegion(engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size)
    except BaseException:
        lease.release()
        raise
    try:
        lease.arrive(role_of(rank))
    except BaseException:
        region.cleanup()
        lease.release()
        raise
    vllm_cleanup = region.cleanup

    def cleanup() -> None:
        try:
            vllm_cleanup()
        finally:
            lease.release()

    region.cleanup = cleanup
    region.kvoffload_lease = lease
    return region
