"""OffloadingWorker over the CPU path: round trips, concurrency, failures, routing."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kvoffload.transfer.gpu_cpu as gpu_cpu
from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvoffload.transfer import (
    HostPool,
    KVGeometry,
    KVLayout,
    OffloadingWorker,
    ThreadPoolTransferHandler,
    TransferResult,
    TransferSpec,
)
from kvoffload.transfer.layout import LAYOUT_KINDS

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def random_fill(tensors: list[torch.Tensor], seed: int) -> None:
    # Random bits, NaN payloads and all: copies must be bit-exact, not value-equal.
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8).clone() for t in tensors]


def store(gpu: list[int], slots: list[int]) -> TransferSpec:
    return TransferSpec(GPULoadStoreSpec(gpu), CPULoadStoreSpec(slots))


def load(slots: list[int], gpu: list[int]) -> TransferSpec:
    return TransferSpec(CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu))


def make(
    kind: str = "layer_first",
    dtype: torch.dtype = torch.float16,
    factor: int = 1,
    num_gpu: int = 16,
    num_slots: int = 8,
    threads: int = 2,
):
    layout = KVLayout(KVGeometry(2, 2, 8, 4, dtype), kind)
    gpu = layout.allocate(num_gpu)
    random_fill(gpu, 7)
    pool = HostPool(layout, num_slots, factor)
    return layout, gpu, pool, OffloadingWorker.for_cpu_tier(gpu, layout, pool, threads)


def settle(worker: OffloadingWorker, ids: list[int]) -> dict[int, TransferResult]:
    assert worker.wait(ids, timeout=30)
    results = {r.job_id: r for r in worker.get_finished()}
    assert set(results) == set(ids)
    return results


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [1, 2])
def test_round_trip_is_bit_identical(kind: str, dtype: torch.dtype, factor: int) -> None:
    layout, gpu, _pool, worker = make(kind, dtype, factor)
    original = as_bytes(gpu)
    gpu_blocks = [9, 2, 14, 3, 5, 11, 0, 7][: 4 * factor]
    slots = [6, 1, 4, 2][:4]
    with worker:
        worker.submit_store(1, store(gpu_blocks, slots))
        res = settle(worker, [1])[1]
        assert res.success and res.error is None
        assert res.num_bytes == len(gpu_blocks) * layout.bytes_per_block
        assert (res.src_medium, res.dst_medium) == ("GPU", "CPU")
        for t in gpu:  # wipe the GPU tier, then bring the blocks back elsewhere
            t.zero_()
        targets = [1, 4, 6, 8, 10, 12, 13, 15][: len(gpu_blocks)]
        worker.submit_load(2, load(slots, targets))
        assert settle(worker, [2])[2].success
    loaded = [p.clone() for p in layout.block_planes(gpu)]
    for t, o in zip(gpu, original):
        t.reshape(-1).view(torch.uint8).copy_(o)
    for got, want in zip(loaded, layout.block_planes(gpu)):
        for src_block, dst_block in zip(gpu_blocks, targets):
            assert torch.equal(got[dst_block], want[src_block])
        untouched = sorted(set(range(16)) - set(targets))
        assert not got[untouched].any()


def test_partial_load_skips_leading_sub_blocks_of_the_first_slot() -> None:
    layout, gpu, _pool, worker = make(factor=4, num_slots=4)
    planes = [p.clone() for p in layout.block_planes(gpu)]
    with worker:
        worker.submit_store(1, store([0, 1, 2, 3, 4, 5, 6, 7], [3, 0]))
        assert settle(worker, [1])[1].success
        worker.submit_load(2, load([3, 0], [8, 9, 10, 11, 12]))  # skip slot 3's first 3 blocks
        res = settle(worker, [2])[2]
    assert res.success and res.num_bytes == 5 * layout.bytes_per_block
    for before, after in zip(planes, layout.block_planes(gpu)):
        for src, dst in zip([3, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
            assert torch.equal(after[dst], before[src])


def test_load_after_store_needs_the_store_to_finish_first() -> None:
    # The worker does not order jobs: the manager only hands out stored slots.
    layout, gpu, _pool, worker = make()
    with worker:
        worker.submit_store(1, store([1], [0]))
        settle(worker, [1])
        worker.submit_load(2, load([0], [2]))
        settle(worker, [2])
    for p in layout.block_planes(gpu):
        assert torch.equal(p[2], p[1])


@pytest.mark.parametrize("shard", [False, True])
def test_concurrent_stores_and_loads_on_disjoint_blocks(
    monkeypatch: pytest.MonkeyPatch, shard: bool
) -> None:
    if shard:  # split even tiny jobs across both threads
        monkeypatch.setattr(gpu_cpu, "SHARD_MIN_BYTES", 0)
    layout, gpu, pool, worker = make("cross_layer", num_gpu=64, num_slots=64, threads=2)
    rng = np.random.default_rng(3)
    # Slots 0..31 are stored now and loaded back below while 32..63 are being stored.
    first = rng.permutation(32)
    with worker:
        worker.submit_store(1, store(first.tolist(), list(range(32))))
        settle(worker, [1])
        snapshot = [p.clone() for p in layout.block_planes(gpu)]
        jobs = []
        for j in range(8):
            gpu_ids = list(range(32 + 4 * j, 36 + 4 * j))  # GPU 32..63 -> slots 32..63
            worker.submit_store(100 + j, store(gpu_ids, [g for g in gpu_ids]))
            jobs.append(100 + j)
        for j in range(4):  # slots 0..31 -> GPU 0..31 in reverse order, in 4 jobs
            slots = list(range(8 * j, 8 * j + 8))
            targets = [31 - s for s in slots]
            worker.submit_load(200 + j, load(slots, targets))
            jobs.append(200 + j)
        results = settle(worker, jobs)
    assert all(r.success for r in results.values()), [r.error for r in results.values()]
    host = pool.planes
    for before, after, hp in zip(snapshot, layout.block_planes(gpu), host):
        for s in range(32):
            assert torch.equal(after[31 - s], before[int(first[s])])
        for g in range(32, 64):
            assert torch.equal(hp[g], before[g])


def _host_bytes(pool: HostPool) -> torch.Tensor:
    return pool.region.reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (store([1, 99], [0, 1]), "GPU block id 99 out of range"),
        (store([1, -1], [0, 1]), "GPU block id -1 out of range"),
        (store([1, 2], [0, 8]), "CPU slot id 8 out of range"),
        (store([1, 2, 3], [0, 1]), "needs exactly 2 GPU blocks"),
        (store([1, 2], [5, 5]), "destination block 5 appears more than once"),
        (load([0, 1], [3]), "expected between 2 and 2 GPU blocks"),
        (load([0], [3, 3]), "expected between 1 and 1"),
        (load([0, 1], [3, 3]), "destination block 3 appears more than once"),
    ],
)
def test_bad_jobs_fail_with_the_reason_and_write_nothing(spec: TransferSpec, reason: str) -> None:
    _layout, gpu, pool, worker = make()
    host_before, gpu_before = _host_bytes(pool), as_bytes(gpu)
    with worker:
        if spec.src.medium() == "GPU":
            worker.submit_store(5, spec)
        else:
            worker.submit_load(5, spec)
        res = settle(worker, [5])[5]
    assert not res.success and res.num_bytes == 0
    assert reason in (res.error or ""), res.error
    assert torch.equal(_host_bytes(pool), host_before)
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(gpu), gpu_before))


def test_a_copy_that_raises_midway_is_reported_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(gpu_cpu, "copy_rows", broken)
    _layout, _gpu, _pool, worker = make()
    with worker:
        worker.submit_store(1, store([1, 2], [0, 1]))
        res = settle(worker, [1])[1]
    assert not res.success
    assert res.error == "RuntimeError: simulated copy failure"


class DiskSpec(LoadStoreSpec):
    def __init__(self, n: int) -> None:
        self.n = n

    @staticmethod
    def medium() -> str:
        return "DISK"


class GatedHandler(ThreadPoolTransferHandler):
    """A pluggable tier handler whose jobs finish only when the gate opens."""

    def __init__(self) -> None:
        super().__init__(num_threads=1)
        self.gate = threading.Event()
        self.seen: list[int] = []

    def prepare(self, job_id: int, spec: TransferSpec):
        if not isinstance(spec.dst, DiskSpec):
            raise ValueError("disk jobs only")
        self.seen.append(job_id)

        def work() -> int:
            self.gate.wait(10)
            return spec.dst.n

        return work


def test_routing_wrong_media_and_directions() -> None:
    _layout, _gpu, _pool, worker = make()
    disk = GatedHandler()
    worker.register_handler("GPU", "DISK", disk)
    with pytest.raises(ValueError, match="already registered"):
        worker.register_handler("GPU", "DISK", disk)
    with pytest.raises(TypeError):
        worker.register_handler("CPU", "DISK", object())  # type: ignore[arg-type]
    with worker:
        worker.submit_store(1, TransferSpec(GPULoadStoreSpec([1]), DiskSpec(4096)))
        worker.submit(2, (GPULoadStoreSpec([1]), GPULoadStoreSpec([2])))  # vLLM-style tuple
        worker.submit_store(3, load([0], [1]))
        worker.submit_load(4, store([1], [0]))
        worker.submit(5, (CPULoadStoreSpec([1]), DiskSpec(1)))
        assert worker.num_in_flight() == 5
        early = {r.job_id: r for r in worker.get_finished()}
        assert set(early) == {2, 3, 4, 5}  # rejected at once; the disk job is gated
        assert "no handler registered for GPU -> GPU" in (early[2].error or "")
        assert "a store copies from GPU" in (early[3].error or "")
        assert "a load copies into GPU" in (early[4].error or "")
        assert "CPU -> DISK" in (early[5].error or "")
        assert not worker.wait([1], timeout=0.05)
        disk.gate.set()
        res = settle(worker, [1])[1]
    assert res.success and res.num_bytes == 4096 and disk.seen == [1]
    assert (res.src_medium, res.dst_medium) == ("GPU", "DISK")
    assert worker.num_in_flight() == 0


def test_job_ids_are_unique_while_in_flight_and_wait_ignores_unknown_ids() -> None:
    _layout, _gpu, _pool, worker = make()
    with worker:
        worker.submit_store(1, store([1], [0]))
        with pytest.raises(ValueError, match="already in use"):
            worker.submit_store(1, store([2], [1]))
        assert worker.wait([1, 12345])
        assert worker.wait([])
        assert [r.job_id for r in worker.get_finished()] == [1]
        assert worker.get_finished() == []
        worker.submit_store(1, store([2], [1]))  # free again once reported
        assert settle(worker, [1])[1].success


def test_empty_job_succeeds() -> None:
    _layout, _gpu, _pool, worker = make(factor=2)
    with worker:
        worker.submit_store(1, store([], []))
        worker.submit_load(2, load([], []))
        results = settle(worker, [1, 2])
    assert all(r.success and r.num_bytes == 0 for r in results.values())


def test_for_cpu_tier_checks_layouts_and_tensors() -> None:
    layout = KVLayout(KVGeometry(2, 2, 8, 4, torch.float16), "layer_first")
    other = KVLayout(KVGeometry(2, 2, 8, 4, torch.float16), "kv_split")
    with pytest.raises(ValueError, match="differs"):
        OffloadingWorker.for_cpu_tier(layout.allocate(4), layout, HostPool(other, 2))
    with pytest.raises(ValueError, match="KV tensor"):
        OffloadingWorker.for_cpu_tier(layout.allocate(4)[:1], layout, HostPool(layout, 2))


def test_a_job_of_a_few_mib_is_split_across_every_pool_thread() -> None:
    """From SHARD_MIN_BYTES (4 MiB) a job uses both threads: one shard per thread halved
    `bench transfer`'s ratio to a bulk copy (0.78-0.99 -> 0.16-0.52 at 256 KiB blocks)."""
    layout = KVLayout(KVGeometry(4, 8, 16, 64, torch.float16), "layer_first")  # 128 KiB a block
    gpu = layout.allocate(64)
    pool = HostPool(layout, 64, 1)
    planner = gpu_cpu.GpuCpuJobPlanner(gpu, layout, pool)
    handler = gpu_cpu.CpuGpuTransferHandler(planner, num_threads=2)
    try:
        small = handler.prepare(1, store(list(range(16)), list(range(16))))  # 2 MiB
        big = handler.prepare(2, store(list(range(40)), list(range(40))))  # 5 MiB
    finally:
        handler.close()
    assert len(small) == 1
    assert len(big) == 2


def test_a_job_of_exactly_shard_min_bytes_is_split() -> None:
    """The threshold is inclusive: a job of exactly SHARD_MIN_BYTES uses every pool thread,
    one block less does not (a `>` there left 4 MiB jobs on one thread)."""
    layout = KVLayout(KVGeometry(4, 8, 16, 64, torch.float16), "layer_first")  # 128 KiB a block
    blocks = gpu_cpu.SHARD_MIN_BYTES // layout.bytes_per_block
    assert blocks * layout.bytes_per_block == gpu_cpu.SHARD_MIN_BYTES
    gpu = layout.allocate(blocks)
    pool = HostPool(layout, blocks, 1)
    handler = gpu_cpu.CpuGpuTransferHandler(
        gpu_cpu.GpuCpuJobPlanner(gpu, layout, pool), num_threads=2
    )
    try:
        exact = handler.prepare(1, store(list(range(blocks)), list(range(blocks))))
        under = handler.prepare(2, store(list(range(blocks - 1)), list(range(blocks - 1))))
    finally:
        handler.close()
    assert len(exact) == 2
    assert len(under) == 1
