"""The disk tier's directory: its manifest (what the blocks were written for) and its lock.

``manifest.json`` records the format, the checksum, the tier fingerprint,
the hash function and the slot geometry. It is written last when a
directory is created (temporary file, fsync, atomic rename), so its presence
means the slabs and the index exist. Re-opening compares every field with
this engine's: a directory written for another model or geometry is refused
with one line naming each differing field (``DiskStoreMismatchError``).

``.lock`` is ``flock``'ed for as long as a process has the directory open:
a second process is refused at once instead of sharing the slabs.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from kvoffload.tiers.disk.index import fsync_dir
from kvoffload.tiers.disk.slabs import DiskStoreError, DiskStoreMismatchError
from kvoffload.tiers.identity import fingerprint_diff

FORMAT_NAME = "kvoffload-disk-tier"
FORMAT_VERSION = 2
CHECKSUM_NAME = "xxh3_64"
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"


def manifest_of(
    geometry_fingerprint: str,
    hash_fn: str,
    block_bytes: int,
    slot_bytes: int,
    capacity_blocks: int,
    blocks_per_file: int,
) -> dict[str, Any]:
    """The manifest a store with these parameters writes (and expects to find)."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "checksum": CHECKSUM_NAME,
        "geometry_fingerprint": geometry_fingerprint,
        "hash_fn": hash_fn,
        "block_bytes": block_bytes,
        "slot_bytes": slot_bytes,
        "capacity_blocks": capacity_blocks,
        "blocks_per_file": blocks_per_file,
    }


def claim_directory(d: Path) -> int:
    """Create ``d`` if needed and take its lock; returns the lock's fd (closing it unlocks).

    Raises ``DiskStoreError`` with one line when ``d`` is not a usable
    directory or another process holds it.
    """
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DiskStoreError(f"disk tier path {d} exists and is not a directory") from None
    except OSError as e:
        raise DiskStoreError(f"cannot create disk tier directory {d}: {e.strerror or e}") from e
    if not d.is_dir():
        raise DiskStoreError(f"disk tier path {d} exists and is not a directory")
    try:
        fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DiskStoreError(f"disk tier directory {d} is not writable: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskStoreError(f"disk tier directory {d} is in use by another process") from None
    return fd


def check_manifest(directory: Path, want: dict[str, Any]) -> None:
    """Refuse ``directory`` unless its manifest equals ``want`` (one line naming each field)."""
    path = directory / MANIFEST_NAME
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DiskStoreMismatchError(
            f"disk tier directory {directory} has an unreadable manifest ({e}); "
            f"delete the directory or use another one"
        ) from e
    if not isinstance(have, dict) or have.get("format") != FORMAT_NAME:
        raise DiskStoreMismatchError(
            f"{path} is not a kvoffload disk tier manifest; use another directory"
        )
    diffs: list[str] = []
    for k, v in want.items():
        if have.get(k) == v:
            continue
        old = have.get(k)
        if k == "geometry_fingerprint" and isinstance(old, str):
            diffs += fingerprint_diff(old, v)
        else:
            diffs.append(f"{k}: {old!r} vs {v!r}")
    if diffs:
        raise DiskStoreMismatchError(
            f"disk tier directory {directory} holds blocks of another model or "
            f"configuration (directory vs this engine: {'; '.join(diffs)}); "
            f"use another directory or delete it"
        )


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest durably and atomically (the last step of creating a directory)."""
    path = directory / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)
