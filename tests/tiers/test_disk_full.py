"""The disk tier on a full filesystem: counted, warned once, recovers, restarts.

ENOSPC is injected by wrapping ``os.write`` (index appends) and ``os.pwritev``
(slab writes); the restart cases also run on a real 2 MiB tmpfs where
mounting is permitted (root), and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvoffload.tiers.disk.index as disk_index
import kvoffload.tiers.disk.store as disk_store
from kvoffload.tiers.disk.index import RECORD_BYTES
from kvoffload.tiers.disk.store import INDEX_NAME, DiskBlockStore
from tests.full_disk import fill, tmpfs
from tests.tiers.tier_rig import Rig, tkey

BB = 8192
LOGGER = "kvoffload.transfer"


def keys_of(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") for i in range(n)]


def blocks_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def open_store(d: Path, capacity: int = 32) -> DiskBlockStore:
    return DiskBlockStore(d, BB, capacity, "g", hash_fn="x", direct_io=False)


class Full:
    """Makes writes to files under ``root`` fail with ENOSPC while ``on`` (partial first)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        self.failures = 0
        real_write, real_pwritev = os.write, os.pwritev

        def write(fd: int, data: bytes | memoryview) -> int:
            if self.on:
                self.failures += 1
                if len(data) > 1 and self.failures % 2:
                    # Half a buffer lands, then the disk is full (the next call fails).
                    return real_write(fd, memoryview(data)[: len(data) // 2 + 3])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        def pwritev(fd: int, bufs: list[object], offset: int) -> int:
            if self.on:
                self.failures += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_pwritev(fd, bufs, offset)  # type: ignore[arg-type]

        monkeypatch.setattr(disk_index.os, "write", write)
        self._pwritev = pwritev
        self._monkeypatch = monkeypatch

    def slabs_too(self) -> None:
        self._monkeypatch.setattr(disk_store.os, "pwritev", self._pwritev)


@pytest.fixture
def full(monkeypatch: pytest.MonkeyPatch) -> Full:
    return Full(monkeypatch)


def messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def test_index_appends_failing_are_counted_warned_once_and_recover(
    tmp_path: Path, full: Full, caplog: pytest.LogCaptureFixture
) -> None:
    s = open_store(tmp_path)
    data = blocks_of(24)
    assert s.put(keys_of(4), data[:4], range(4)) == [True] * 4
    full.on = True
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(4, 16):
            # The slab write lands (preallocated); only the index record is refused.
            assert s.put(keys_of(1, base=i), data[i : i + 1], [i]) == [True]
        assert s.remove(keys_of(1, base=0)) == 1
    assert s.stats.index_errors == 13
    assert len(messages(caplog, "filesystem is full")) == 1
    size = (tmp_path / INDEX_NAME).stat().st_size
    assert size % RECORD_BYTES == 0, "a partial append was cut back"
    out = np.zeros((16, BB), dtype=np.uint8)
    assert s.get_into(keys_of(15, base=1), out[:15]) == [True] * 15  # served meanwhile
    full.on = False
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert s.put(keys_of(8, base=16), data[16:24], range(16, 24)) == [True] * 8
    assert messages(caplog, "succeed again") == [
        f"disk tier {tmp_path}: writes succeed again (0 block writes and 13 index records "
        "failed meanwhile)"
    ]
    s.close()
    # After a restart: what was indexed before and after the full spell is back; the
    # blocks whose records were refused are lost (never wrong).
    s = open_store(tmp_path)
    try:
        # Key 0's DEL was refused: it comes back, with its own bytes (slot 0 was not reused).
        assert s.contains_many(keys_of(24)) == [True] * 4 + [False] * 12 + [True] * 8
        assert s.get_into(keys_of(1), out[:1]) == [True] and np.array_equal(out[0], data[0])
        assert s.get_into(keys_of(8, base=16), out[:8]) == [True] * 8
        assert np.array_equal(out[:8], data[16:24])
    finally:
        s.close()


def test_slab_writes_failing_are_counted_and_recover(
    tmp_path: Path, full: Full, caplog: pytest.LogCaptureFixture
) -> None:
    s = open_store(tmp_path)
    data = blocks_of(8)
    full.slabs_too()
    full.on = True
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(6):
            assert s.put(keys_of(1, base=i), data[i : i + 1], [i]) == [False]
    assert s.stats.write_errors == 6 and len(s) == 0
    assert len(messages(caplog, "filesystem is full")) == 1
    full.on = False
    assert s.put(keys_of(2, base=6), data[6:], [6, 7]) == [True, True]
    assert "6 block writes" in " ".join(messages(caplog, "succeed again"))
    s.close()


def test_write_downs_to_a_full_disk_warn_once_per_spell(
    tmp_path: Path, full: Full, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(cpu_blocks=1, disk_dir=tmp_path, disk_blocks=16)
    try:
        full.slabs_too()
        full.on = True
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for i in range(8):
                assert rig.store([i])  # the CPU tier goes on; write-downs fail
        assert len(messages(caplog, "copies are failing")) == 1
        assert rig.tiers.handler.stats.best_effort_failures == 7
        full.on = False
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for i in range(8, 12):
                assert rig.store([i])
        assert messages(caplog, "succeed again after 7 failed")
        rig.clobber()
        assert rig.load([10]) == (1, True)
    finally:
        rig.close()


def test_restart_on_a_full_disk_with_a_torn_index(
    tmp_path: Path, full: Full, caplog: pytest.LogCaptureFixture
) -> None:
    s = open_store(tmp_path)
    data = blocks_of(8)
    assert s.put(keys_of(8), data, range(8)) == [True] * 8
    s.close()
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(b"torn")  # a crash mid-append
    full.on = True  # the compaction a torn log asks for cannot be written
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = open_store(tmp_path)
    try:
        assert messages(caplog, "could not compact")
        assert (tmp_path / INDEX_NAME).stat().st_size == 8 * RECORD_BYTES  # tail cut off
        out = np.zeros_like(data)
        assert s.get_into(keys_of(8), out) == [True] * 8
        assert np.array_equal(out, data)
    finally:
        s.close()


# -- a real full filesystem -----------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt


def test_tmpfs_fills_mid_run_then_restart_while_full_then_room_returns(
    tiny_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tiny_fs / "tier"
    s = open_store(d, capacity=160)  # 1.25 MiB of slabs on a 2 MiB filesystem
    data = blocks_of(160)
    assert all(s.put(keys_of(40), data[:40], range(40)))
    filler = fill(tiny_fs)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(40, 160, 8):
            s.put(keys_of(8, base=i), data[i : i + 8], range(i, i + 8))
    assert s.stats.index_errors > 0
    assert len(messages(caplog, "filesystem is full")) == 1
    out = np.zeros_like(data)
    assert s.get_into(keys_of(160), out) == [True] * 160  # all served in this process
    assert np.array_equal(out, data)
    s.close()
    with open(d / INDEX_NAME, "r+b") as f:  # a torn tail, as after a crash
        f.truncate(os.path.getsize(d / INDEX_NAME) - 7)
    # Restart while still full: refused before ([Errno 28]); now it opens.
    s = open_store(d, capacity=160)
    try:
        have = [i for i, h in enumerate(s.contains_many(keys_of(160))) if h]
        assert have and s.get_into([keys_of(160)[i] for i in have], out[: len(have)]) == [
            True
        ] * len(have)
        assert np.array_equal(out[: len(have)], data[have])
        filler.unlink()  # room returns
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            missing = [i for i in range(160) if i not in set(have)]
            assert all(s.put([keys_of(160)[i] for i in missing], data[missing], missing))
    finally:
        s.close()
    s = open_store(d, capacity=160)
    try:
        assert s.get_into(keys_of(160), out) == [True] * 160
        assert np.array_equal(out, data)
    finally:
        s.close()


def test_rig_on_a_full_tmpfs_keeps_answers(tiny_fs: Path) -> None:
    rig = Rig(cpu_blocks=1, disk_dir=tiny_fs / "tier", disk_blocks=64)
    try:
        fill(tiny_fs)
        for i in range(40):
            assert rig.store([i])
        rig.clobber()
        for i in range(39):
            got, ok = rig.load([i])  # the rig checks every byte it loads
            assert got in (0, 1) and (ok or got == 0)
        assert rig.m.tier_of([tkey(0)]) in (["DISK"], ["CPU"], [None])
    finally:
        rig.close()
