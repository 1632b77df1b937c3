"""DiskBlockStore: round trips, restart recovery, corruption/truncation, bad directories."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvoffload.tiers.disk.store import (
    INDEX_NAME,
    MANIFEST_NAME,
    DiskBlockStore,
    DiskStoreError,
    DiskStoreMismatchError,
)
from kvoffload.transfer.block_buffers import aligned_empty

GEOM = "layers=2,kv_heads=2,head=8,block=4,dtype=float16,layout=per_layer"


def keys_of(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]


def blocks_of(n: int, block_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def open_store(
    d: Path, block_bytes: int = 8192, capacity: int = 64, **kw: object
) -> DiskBlockStore:
    kw.setdefault("hash_fn", "xxhash64")
    return DiskBlockStore(d, block_bytes, capacity, GEOM, **kw)  # type: ignore[arg-type]


def slab(d: Path, i: int = 0) -> Path:
    return d / f"slab-{i:05d}.bin"


# -- round trips --------------------------------------------------------------


@pytest.mark.parametrize("direct_io", [None, False])
@pytest.mark.parametrize("block_bytes", [4096, 8192, 1000, 3 * 4096 + 17])
def test_round_trip_bit_identical(tmp_path: Path, block_bytes: int, direct_io: bool | None) -> None:
    with open_store(tmp_path, block_bytes, 40, direct_io=direct_io, blocks_per_file=16) as s:
        data = blocks_of(30, block_bytes)
        keys = keys_of(30)
        # Scattered slots: runs, gaps and a run across a file boundary (15|16).
        slots = [*range(10, 20), 0, 2, 4, *range(30, 40), 5, 6, 7, 21, 23, 25, 27]
        assert s.put(keys, data, slots) == [True] * 30
        out = np.zeros_like(data)
        assert s.get_into(keys, out) == [True] * 30
        assert np.array_equal(out, data)
        # With the slots given too.
        out2 = np.zeros_like(data)
        assert s.get_into(keys, out2, slots) == [True] * 30
        assert np.array_equal(out2, data)


def test_reads_into_caller_buffers_of_many_kinds(tmp_path: Path) -> None:
    bb = 8192
    with open_store(tmp_path, bb) as s:
        data = blocks_of(4, bb)
        src_tensor = torch.from_numpy(data.copy()).view(torch.float16)  # any dtype, same bytes
        assert s.put(keys_of(4), src_tensor, [0, 1, 2, 3]) == [True] * 4
        # An aligned buffer (the O_DIRECT zero-copy path) and an unaligned one.
        aligned = aligned_empty(4 * bb).reshape(4, bb)
        assert s.get_into(keys_of(4), aligned) == [True] * 4
        assert np.array_equal(aligned, data)
        raw = np.zeros(4 * bb + 1, dtype=np.uint8)
        unaligned = [raw[1 + i * bb : 1 + (i + 1) * bb] for i in range(4)]
        assert s.get_into(keys_of(4), unaligned) == [True] * 4
        assert np.array_equal(np.stack(unaligned), data)
        # Rows of a torch tensor (a host pool's slots) as destination.
        pool = torch.zeros(8, bb // 2, dtype=torch.float16)
        assert s.get_into(keys_of(4), [pool[i] for i in (7, 5, 3, 1)]) == [True] * 4
        assert np.array_equal(pool[[7, 5, 3, 1]].view(torch.uint8).numpy(), data)


def test_large_batch_uses_the_pool_and_stays_identical(tmp_path: Path) -> None:
    bb = 64 * 1024
    with open_store(tmp_path, bb, 64, num_io_threads=3) as s:
        data = blocks_of(48, bb, seed=3)
        slots = list(np.random.default_rng(1).permutation(64)[:48])
        assert all(s.put(keys_of(48), data, slots))
        got = s.get(keys_of(48))
        assert all(g is not None and np.array_equal(g, data[i]) for i, g in enumerate(got))


def test_miss_for_unknown_key_and_wrong_slot(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        data = blocks_of(2, 8192)
        s.put(keys_of(2), data, [3, 4])
        assert s.get(keys_of(1, base=99)) == [None]
        assert s.get_into(keys_of(1), np.empty((1, 8192), np.uint8), slots=[4]) == [False]
        assert s.contains(keys_of(1)[0]) and s.contains(keys_of(1)[0], 3)
        assert not s.contains(keys_of(1)[0], 4)


def test_overwrite_slot_and_move_key(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        a, b = keys_of(2)
        d = blocks_of(3, 8192)
        s.put([a], d[0:1], [5])
        s.put([b], d[1:2], [5])  # slot 5 now holds b; a is gone
        assert s.get([a]) == [None]
        assert np.array_equal(s.get([b])[0], d[1])
        s.put([b], d[2:3], [9])  # b moves to slot 9
        assert s.slot_of(b) == 9 and len(s) == 1
        assert np.array_equal(s.get([b])[0], d[2])


def test_remove_and_clear(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        s.put(keys_of(5), blocks_of(5, 8192), range(5))
        assert s.remove(keys_of(2)) == 2
        assert len(s) == 3
        s.clear()
        assert len(s) == 0
    with open_store(tmp_path) as s:
        assert len(s) == 0


def test_bad_arguments(tmp_path: Path) -> None:
    with open_store(tmp_path, capacity=8) as s:
        with pytest.raises(ValueError, match="out of range"):
            s.put(keys_of(1), blocks_of(1, 8192), [8])
        with pytest.raises(ValueError, match="distinct"):
            s.put(keys_of(2), blocks_of(2, 8192), [1, 1])
        with pytest.raises(ValueError, match="bytes"):
            s.put(keys_of(1), blocks_of(1, 100), [1])
        with pytest.raises(ValueError, match="writable"):
            ro = np.zeros((1, 8192), np.uint8)
            ro.flags.writeable = False
            s.put(keys_of(1), blocks_of(1, 8192), [0])
            s.get_into(keys_of(1), ro)
    for bad in ({"block_bytes": 0}, {"capacity": 0}):
        with pytest.raises(ValueError):
            open_store(tmp_path / "x", **bad)  # type: ignore[arg-type]


# -- restart recovery ---------------------------------------------------------


def test_restart_recovers_every_block(tmp_path: Path) -> None:
    data = blocks_of(20, 8192, seed=5)
    with open_store(tmp_path) as s:
        s.put(keys_of(20), data, range(20, 40))
        s.remove(keys_of(2))  # removals survive too
    with open_store(tmp_path) as s:
        assert len(s) == 18
        entries = s.entries()
        assert [e.key for e in entries] == keys_of(18, base=2)  # oldest write first
        assert [e.slot for e in entries] == list(range(22, 40))
        got = s.get(keys_of(20))
        assert got[:2] == [None, None]
        assert all(np.array_equal(g, data[i]) for i, g in enumerate(got) if i >= 2)


def test_restart_after_crash_without_close(tmp_path: Path) -> None:
    """A process killed without closing: what was put is found again."""
    data = blocks_of(6, 8192, seed=9)
    s = open_store(tmp_path)
    s.put(keys_of(6), data, range(6))
    # Simulate the kill: drop fds (and the flock) without the close path's flush.
    s._pool.shutdown()
    s._release()
    with open_store(tmp_path) as s2:
        got = s2.get(keys_of(6))
        assert all(np.array_equal(g, data[i]) for i, g in enumerate(got))


def test_torn_index_tail_is_ignored(tmp_path: Path) -> None:
    data = blocks_of(4, 8192)
    with open_store(tmp_path) as s:
        s.put(keys_of(4), data, range(4))
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(b"KVIX\x01garbage")  # half a record, as after a crash mid-append
    with open_store(tmp_path) as s:
        got = s.get(keys_of(4))
        assert all(np.array_equal(g, data[i]) for i, g in enumerate(got))


def test_damaged_index_record_drops_only_that_entry(tmp_path: Path) -> None:
    data = blocks_of(4, 8192)
    with open_store(tmp_path) as s:
        s.put(keys_of(4), data, range(4))
    raw = bytearray((tmp_path / INDEX_NAME).read_bytes())
    raw[96 + 20] ^= 0xFF  # inside the second record
    (tmp_path / INDEX_NAME).write_bytes(bytes(raw))
    with open_store(tmp_path) as s:
        assert s.contains_many(keys_of(4)) == [True, False, True, True]


def test_index_is_compacted(tmp_path: Path) -> None:
    with open_store(tmp_path, capacity=4) as s:
        d = blocks_of(1, 8192)
        for i in range(1500):
            s.put(keys_of(1, base=i), d, [i % 4])
        assert (tmp_path / INDEX_NAME).stat().st_size < 2000 * 96
    with open_store(tmp_path, capacity=4) as s:
        assert s.contains_many(keys_of(4, base=1496)) == [True] * 4


# -- corruption and truncation ------------------------------------------------


def test_corrupt_block_is_a_miss_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = blocks_of(4, 8192)
    with open_store(tmp_path) as s:
        s.put(keys_of(4), data, range(4))
        slot_bytes = s.slot_bytes
    with open(slab(tmp_path), "r+b") as f:
        f.seek(2 * slot_bytes + 100)
        f.write(b"\x00\x01\x02")
    with open_store(tmp_path) as s:
        out = np.zeros_like(data)
        with caplog.at_level(logging.WARNING):
            assert s.get_into(keys_of(4), out) == [True, True, False, True]
        assert "checksum mismatch" in caplog.text
        assert s.stats.corrupt_blocks == 1
        assert not s.contains(keys_of(4)[2])
        assert np.array_equal(out[[0, 1, 3]], data[[0, 1, 3]])
    with open_store(tmp_path) as s:  # the drop is persistent
        assert s.contains_many(keys_of(4)) == [True, True, False, True]


def test_corruption_while_open(tmp_path: Path) -> None:
    data = blocks_of(3, 8192)
    with open_store(tmp_path, direct_io=False) as s:
        s.put(keys_of(3), data, [0, 1, 2])
        with open(slab(tmp_path), "r+b") as f:
            f.seek(s.slot_bytes + 8191)
            f.write(bytes([data[1, 8191] ^ 1]))  # one bit of the last byte
        assert [g is None for g in s.get(keys_of(3))] == [False, True, False]


def test_truncated_slab_while_open(tmp_path: Path) -> None:
    data = blocks_of(8, 8192)
    with open_store(tmp_path, capacity=8) as s:
        s.put(keys_of(8), data, range(8))
        os.truncate(slab(tmp_path), 5 * s.slot_bytes + 10)
        got = s.get(keys_of(8))
        assert [g is None for g in got] == [False] * 5 + [True] * 3
        assert s.stats.truncated_blocks == 3
        assert all(np.array_equal(got[i], data[i]) for i in range(5))


def test_truncated_slab_between_runs(tmp_path: Path) -> None:
    data = blocks_of(8, 8192)
    with open_store(tmp_path, capacity=8) as s:
        s.put(keys_of(8), data, range(8))
        slot_bytes = s.slot_bytes
    os.truncate(slab(tmp_path), 3 * slot_bytes + 100)
    with open_store(tmp_path, capacity=8) as s:
        assert len(s) == 3
        assert slab(tmp_path).stat().st_size == 8 * slot_bytes  # re-extended
        # The lost slots are usable again.
        assert s.put(keys_of(1, base=50), data[:1], [6]) == [True]
        assert np.array_equal(s.get(keys_of(1, base=50))[0], data[0])


def test_missing_slab_file(tmp_path: Path) -> None:
    data = blocks_of(4, 8192)
    with open_store(tmp_path, capacity=4, blocks_per_file=2) as s:
        s.put(keys_of(4), data, range(4))
    slab(tmp_path, 1).unlink()
    with open_store(tmp_path, capacity=4, blocks_per_file=2) as s:
        assert s.contains_many(keys_of(4)) == [True, True, False, False]


# -- the manifest: incompatible engines ----------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"geometry": "layers=3"}, "layers: "),
        ({"hash_fn": "sha256_cbor"}, "hash_fn"),
        ({"block_bytes": 4096}, "block_bytes"),
        ({"capacity": 32}, "capacity_blocks"),
    ],
)
def test_mismatched_engine_refuses_to_open(
    tmp_path: Path, change: dict[str, object], field: str
) -> None:
    with open_store(tmp_path):
        pass
    kw: dict[str, object] = {"hash_fn": "xxhash64"}
    geom, bb, cap = GEOM, 8192, 64
    geom = str(change.get("geometry", geom))
    bb = int(change.get("block_bytes", bb))  # type: ignore[call-overload]
    cap = int(change.get("capacity", cap))  # type: ignore[call-overload]
    if "hash_fn" in change:
        kw["hash_fn"] = change["hash_fn"]
    with pytest.raises(DiskStoreMismatchError, match=field):
        DiskBlockStore(tmp_path, bb, cap, geom, **kw)  # type: ignore[arg-type]


def test_unreadable_or_foreign_manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DiskStoreMismatchError, match="unreadable manifest"):
        open_store(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "other"}))
    with pytest.raises(DiskStoreMismatchError, match="not a kvoffload"):
        open_store(tmp_path)


def test_half_created_directory_is_recreated(tmp_path: Path) -> None:
    """Slabs and index but no manifest (a crash during creation): start empty."""
    with open_store(tmp_path) as s:
        s.put(keys_of(2), blocks_of(2, 8192), [0, 1])
    (tmp_path / MANIFEST_NAME).unlink()
    with open_store(tmp_path) as s:
        assert len(s) == 0


# -- start-up errors ----------------------------------------------------------


def test_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DiskStoreError, match="not a directory"):
        open_store(f)
    with pytest.raises(DiskStoreError, match="cannot create"):
        open_store(f / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(DiskStoreError, match="not writable"):
            open_store(d)
        with pytest.raises(DiskStoreError, match="cannot create"):
            open_store(d / "sub")
    finally:
        d.chmod(0o700)


def test_unwritable_directory_even_for_root() -> None:
    """/proc refuses new files whatever the user."""
    with pytest.raises(DiskStoreError):
        open_store(Path("/proc/kvoffload-disk-tier"))


def test_not_enough_space(tmp_path: Path) -> None:
    with pytest.raises(DiskStoreError, match="not enough free space"):
        DiskBlockStore(tmp_path, 1 << 30, 1 << 20, GEOM)  # a petabyte


def test_second_process_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path), pytest.raises(DiskStoreError, match="in use"):
        open_store(tmp_path)
    with open_store(tmp_path):  # free again once closed
        pass


def test_required_direct_io_or_clear_error(tmp_path: Path) -> None:
    try:
        s = open_store(tmp_path, direct_io=True)
    except DiskStoreError as e:
        assert "O_DIRECT" in str(e)
    else:
        assert s.direct_io
        s.close()
    with open_store(tmp_path / "b", direct_io=False) as s:
        assert not s.direct_io


def test_closed_store_refuses_io(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    s.close()
    s.close()  # idempotent
    with pytest.raises(DiskStoreError, match="closed"):
        s.get(keys_of(1))


# -- concurrency --------------------------------------------------------------


def test_concurrent_puts_and_gets_on_disjoint_slots(tmp_path: Path) -> None:
    bb = 8192
    with open_store(tmp_path, bb, 64) as s:
        errors: list[str] = []

        def worker(t: int) -> None:
            data = blocks_of(8, bb, seed=t)
            keys = keys_of(8, base=100 * t)
            slots = list(range(8 * t, 8 * t + 8))
            for _ in range(5):
                if not all(s.put(keys, data, slots)):
                    errors.append(f"put {t}")
                got = s.get(keys)
                if not all(g is not None and np.array_equal(g, data[i]) for i, g in enumerate(got)):
                    errors.append(f"get {t}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        assert len(s) == 32
