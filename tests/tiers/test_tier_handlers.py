"""CPU <-> DISK and CPU <-> REMOTE handlers on a real host pool, every layout and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvoffload.offload import CPULoadStoreSpec, make_offload_key
from kvoffload.tiers.disk.handler import DiskTransferHandler
from kvoffload.tiers.disk.store import DiskBlockStore
from kvoffload.tiers.identity import tier_fingerprint
from kvoffload.tiers.lower_tier import DiskLoadStoreSpec, RemoteLoadStoreSpec, TieredLoadStoreSpec
from kvoffload.tiers.redis.handler import RedisTransferHandler
from kvoffload.tiers.redis.store import RedisBlockStore
from kvoffload.tiers.slot_io import SlotIO
from kvoffload.tiers.tiered_handler import TieredTransferHandler
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVGeometry, KVLayout
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.worker import make_cpu_gpu_handler
from tests.conftest_redis import RedisServer

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
KINDS = ["layer_first", "kv_split", "cross_layer"]


def pool_of(kind: str, dtype: torch.dtype, slots: int = 8, factor: int = 1) -> HostPool:
    g = KVGeometry(num_layers=3, num_kv_heads=2, head_size=16, block_size=4, dtype=dtype)
    pool = HostPool(KVLayout(g, kind), slots, factor, pin_memory=False)
    raw = pool.region.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    return pool


def keys(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big")) for i in ids]


def run(handler: object, spec: TransferSpec) -> tuple[bool, str | None]:
    handler.submit(1, spec)  # type: ignore[attr-defined]
    handler.wait([1])  # type: ignore[attr-defined]
    (res,) = handler.get_finished()  # type: ignore[attr-defined]
    return res.success, res.error


def test_fingerprint_names_everything() -> None:
    g = KVGeometry(num_layers=3, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.bfloat16)
    fp = tier_fingerprint(KVLayout(g, "kv_split"), 2)
    for part in ("layers=3", "kv_heads=2", "head_size=16", "block_size=4", "bfloat16"):
        assert part in fp
    assert "layout=kv_split" in fp and "block_size_factor=2" in fp
    assert fp != tier_fingerprint(KVLayout(g, "layer_first"), 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("factor", [1, 2])
def test_disk_round_trip_bit_identical(
    tmp_path: Path, kind: str, dtype: torch.dtype, factor: int
) -> None:
    pool = pool_of(kind, dtype, factor=factor)
    assert SlotIO(pool).zero_copy == (kind == "cross_layer")
    store = DiskBlockStore(tmp_path, pool.slot_bytes, 16, "g")
    h = DiskTransferHandler(store, pool)
    before = pool.read_slots([1, 3, 5]).clone()
    assert run(
        h, TransferSpec(CPULoadStoreSpec([1, 3, 5]), DiskLoadStoreSpec([7, 0, 8], keys(1, 3, 5)))
    )[0]
    pool.region.view(torch.uint8).zero_()
    assert run(
        h, TransferSpec(DiskLoadStoreSpec([7, 0, 8], keys(1, 3, 5)), CPULoadStoreSpec([6, 2, 4]))
    )[0]
    assert torch.equal(pool.read_slots([6, 2, 4]), before)
    h.close()
    store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_redis_round_trip_bit_identical(redis_server: RedisServer, kind: str) -> None:
    pool = pool_of(kind, torch.bfloat16)
    store = RedisBlockStore(redis_server.url, "t", pool.slot_bytes)
    h = RedisTransferHandler(store, pool)
    before = pool.read_slots([0, 7]).clone()
    assert run(h, TransferSpec(CPULoadStoreSpec([0, 7]), RemoteLoadStoreSpec(keys(1, 2))))[0]
    pool.region.view(torch.uint8).zero_()
    assert run(h, TransferSpec(RemoteLoadStoreSpec(keys(1, 2)), CPULoadStoreSpec([3, 4])))[0]
    assert torch.equal(pool.read_slots([3, 4]), before)
    h.close()


def test_disk_misses_fail_the_job_and_leave_other_slots_alone(tmp_path: Path) -> None:
    pool = pool_of("layer_first", torch.float16)
    store = DiskBlockStore(tmp_path, pool.slot_bytes, 16, "g")
    h = DiskTransferHandler(store, pool)
    assert run(h, TransferSpec(CPULoadStoreSpec([1]), DiskLoadStoreSpec([0], keys(1))))[0]
    slot2 = pool.read_slots([2]).clone()
    ok, err = run(h, TransferSpec(DiskLoadStoreSpec([0, 1], keys(1, 9)), CPULoadStoreSpec([3, 2])))
    assert not ok and "1 of 2 disk blocks could not be read" in (err or "")
    assert torch.equal(pool.read_slots([2]), slot2)  # a miss never lands in a slot (staged path)
    h.close()
    store.close()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            TransferSpec(CPULoadStoreSpec([1, 2]), DiskLoadStoreSpec([0], keys(1))),
            "2 blocks into 1",
        ),
        (TransferSpec(CPULoadStoreSpec([99]), DiskLoadStoreSpec([0], keys(1))), "out of range"),
        (TransferSpec(CPULoadStoreSpec([1]), RemoteLoadStoreSpec(keys(1))), "CPU<->DISK only"),
    ],
)
def test_disk_bad_jobs_are_reported(tmp_path: Path, spec: TransferSpec, match: str) -> None:
    pool = pool_of("layer_first", torch.float16)
    store = DiskBlockStore(tmp_path, pool.slot_bytes, 16, "g")
    h = DiskTransferHandler(store, pool)
    ok, err = run(h, spec)
    assert not ok and match in (err or "")
    h.close()
    store.close()


def test_mismatched_block_size_is_a_start_up_error(tmp_path: Path) -> None:
    pool = pool_of("layer_first", torch.float16)
    store = DiskBlockStore(tmp_path, pool.slot_bytes + 1, 4, "g")
    with pytest.raises(ValueError, match="another geometry"):
        DiskTransferHandler(store, pool)
    store.close()
    r = RedisBlockStore("redis://127.0.0.1:1/0", "t", 3, check_connection=False)
    with pytest.raises(ValueError, match="another geometry"):
        RedisTransferHandler(r, pool)


def test_redis_outage_fails_jobs_fast(redis_server: RedisServer) -> None:
    pool = pool_of("layer_first", torch.float16)
    store = RedisBlockStore(redis_server.url, "t", pool.slot_bytes, retry_interval_s=0)
    h = RedisTransferHandler(store, pool)
    redis_server.kill()
    ok, err = run(h, TransferSpec(CPULoadStoreSpec([1]), RemoteLoadStoreSpec(keys(1))))
    assert not ok and "could not be stored" in (err or "")
    h.close()


def test_tiered_handler_rejects_error_specs_and_unknown_steps(tmp_path: Path) -> None:
    pool = pool_of("layer_first", torch.float16)
    layout = pool.layout
    gpu = layout.allocate(8)
    h = TieredTransferHandler(make_cpu_gpu_handler(gpu, layout, pool))
    from kvoffload.offload import GPULoadStoreSpec
    from kvoffload.tiers.lower_tier import TierCopy

    bad = TieredLoadStoreSpec(CPULoadStoreSpec([]), error="no CPU room")
    ok, err = run(h, TransferSpec(bad, GPULoadStoreSpec([])))
    assert not ok and "no CPU room" in (err or "")
    step = TierCopy(DiskLoadStoreSpec([0], keys(1)), CPULoadStoreSpec([0]), True)
    spec = TieredLoadStoreSpec(CPULoadStoreSpec([0]), [step])
    h2 = TieredTransferHandler(make_cpu_gpu_handler(gpu, layout, pool))
    ok, err = run(h2, TransferSpec(spec, GPULoadStoreSpec([1])))
    assert not ok and "DISK -> CPU" in (err or "")
    h.close()
    h2.close()
