"""HostPool: sizing, slot addressing, pinning rule, serialised slot bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import LAYOUT_KINDS, KVGeometry, KVLayout

GEOM = KVGeometry(2, 2, 4, 4, torch.float32)


def test_sizes_and_region() -> None:
    pool = HostPool(KVLayout(GEOM, "layer_first"), num_slots=5, block_size_factor=3)
    assert pool.num_sub_blocks == 15
    assert pool.slot_bytes == 3 * GEOM.bytes_per_block
    assert pool.nbytes == 5 * pool.slot_bytes == pool.region.numel() * 4
    assert pool.layout.num_blocks_of(pool.tensors) == 15
    assert pool.pinned == torch.cuda.is_available()
    assert not HostPool(KVLayout(GEOM), 1, pin_memory=False).pinned


def test_from_budget() -> None:
    layout = KVLayout(GEOM, "cross_layer")
    pool = HostPool.from_budget(layout, 10 * GEOM.bytes_per_block + 1, block_size_factor=2)
    assert pool.num_slots == 5
    with pytest.raises(ValueError, match="smaller than one CPU block"):
        HostPool.from_budget(layout, GEOM.bytes_per_block, block_size_factor=2)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_rejects_bad_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="num_slots"):
        HostPool(KVLayout(GEOM), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size_factor"):
        HostPool(KVLayout(GEOM), 2, bad)  # type: ignore[arg-type]


def test_sub_block_ids_and_slot_checks() -> None:
    pool = HostPool(KVLayout(GEOM), num_slots=4, block_size_factor=3)
    assert pool.sub_block_ids([2, 0]).tolist() == [6, 7, 8, 0, 1, 2]
    assert pool.sub_block_ids(np.zeros(0, dtype=np.int64)).size == 0
    with pytest.raises(ValueError, match=r"CPU slot id 4 out of range \[0, 4\)"):
        pool.sub_block_ids([1, 4])
    with pytest.raises(ValueError, match="-1 out of range"):
        pool.check_slots([-1])
    with pytest.raises(ValueError, match="1-D"):
        pool.check_slots([[1]])


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_read_write_slots_round_trip(kind: str) -> None:
    pool = HostPool(KVLayout(GEOM, kind), num_slots=4, block_size_factor=2)
    data = torch.randint(0, 256, (2, pool.slot_bytes), dtype=torch.uint8)
    pool.write_slots([3, 1], data)
    assert torch.equal(pool.read_slots([3, 1]), data)
    assert torch.equal(pool.read_slots([1]), data[1:])
    # Slot 3's sub-blocks are rows 6 and 7 of every plane, in order.
    first_plane_row = pool.planes[0][6]
    assert torch.equal(first_plane_row, data[0, : pool.layout.plane_row_bytes])
    with pytest.raises(ValueError, match="distinct"):
        pool.write_slots([1, 1], data)
    with pytest.raises(ValueError, match="uint8"):
        pool.write_slots([1], data[:1].float())


def test_adopts_a_buffer() -> None:
    layout = KVLayout(GEOM, "kv_split")
    buffer = torch.zeros(3 * GEOM.bytes_per_block + 64, dtype=torch.uint8)
    pool = HostPool(layout, 3, buffer=buffer)
    pool.tensors[0].fill_(1.0)
    assert buffer.view(torch.float32)[0] == 1.0
    with pytest.raises(ValueError, match="needs"):
        HostPool(layout, 4, buffer=buffer)
    with pytest.raises(ValueError, match="uint8"):
        HostPool(layout, 1, buffer=buffer.view(torch.float32))


def test_pins_in_place_exactly_and_unregisters(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated CUDA: the region is registered as allocated (no power-of-two
    # rounding) and unregistered when the pool goes away.
    import gc

    import kvoffload.transfer.host_pool as hp

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(hp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hp, "pin_in_place", lambda t: calls.append(("reg", t.data_ptr())) or True)
    monkeypatch.setattr(hp, "unpin", lambda t: calls.append(("unreg", t.data_ptr())))
    pool = HostPool(KVLayout(GEOM), 3)
    assert pool.pinned and pool.region.numel() * 4 == pool.nbytes
    ptr = pool.region.data_ptr()
    del pool
    gc.collect()
    assert calls == [("reg", ptr), ("unreg", ptr)]


def test_host_buffer_is_zeroed_aligned_and_kept_alive() -> None:
    import gc

    from kvoffload.transfer.host_memory import HUGE_PAGE_BYTES, host_buffer

    big = host_buffer(9 << 20)
    gc.collect()  # the mapping must outlive the local that created it
    assert big.numel() == 9 << 20 and big.dtype == torch.uint8 and not big.any()
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0 or not hasattr(__import__("mmap"), "MADV_HUGEPAGE")
    big.fill_(7)
    assert int(big[-1]) == 7
    assert host_buffer(100).numel() == 100
    with pytest.raises(ValueError, match="positive"):
        host_buffer(0)


def test_over_tensors_reads_and_writes_strided_shared_rows_in_place() -> None:
    """Rows of a wider buffer (a shared region whose row holds every rank's shard)."""
    geometry = KVGeometry(
        num_layers=3, num_kv_heads=1, head_size=8, block_size=1, dtype=torch.uint8
    )
    layout = KVLayout(geometry, "kv_split")
    row, num_slots, row_stride = 16, 4, 3 * 16 * 2 + 32  # two ranks, padding after them
    buffer = torch.zeros(num_slots * row_stride, dtype=torch.uint8)
    rank_offset = 3 * row  # rank 1's shard starts after rank 0's three planes
    tensors = [
        torch.as_strided(buffer, (num_slots, row), (row_stride, 1), rank_offset + p * row).view(
            num_slots, 2, 1, 1, 8
        )
        for p in range(3)
    ]
    pool = HostPool.over_tensors(layout, tensors)
    assert pool.num_slots == num_slots and pool.region is None and not pool.pinned
    data = torch.arange(2 * pool.slot_bytes, dtype=torch.int64).to(torch.uint8).view(2, -1)
    pool.write_slots([3, 1], data)
    assert torch.equal(pool.read_slots([3, 1]), data)
    rows = buffer.view(num_slots, row_stride)
    assert torch.equal(rows[3, rank_offset : rank_offset + 3 * row], data[0])
    assert not rows[:, :rank_offset].any() and not rows[:, rank_offset + 3 * row :].any()
    with pytest.raises(ValueError, match="multiple of"):
        HostPool.over_tensors(layout, tensors, block_size_factor=3)
