"""The CUDA stream handler: bookkeeping on CPU with a stand-in stream API, real runs on CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import (
    CudaStreamTransferHandler,
    GpuCpuJobPlanner,
    HostPool,
    KVGeometry,
    KVLayout,
    OffloadingWorker,
    TransferSpec,
)
from kvoffload.transfer.cuda_streams import TRANSFER_STREAM_PRIORITY
from kvoffload.transfer.layout import LAYOUT_KINDS


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.error: Exception | None = None
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        stream.events.append(self)

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done

    def synchronize(self) -> None:
        if self.error is not None:
            raise self.error
        self.done = True


class FakeStream:
    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.priority = priority
        self.events: list[FakeEvent] = []
        self.waited_on: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_on.append(other)


class FakeStreamAPI:
    """Just enough of ``torch.cuda`` for the handler; copies run eagerly on CPU."""

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.active: list[FakeStream] = []

    def Stream(self, device: object = None, priority: int = 0) -> FakeStream:
        return FakeStream(device, priority)

    def Event(self) -> FakeEvent:
        return FakeEvent()

    def current_stream(self, device: object = None) -> FakeStream:
        return self.active[-1] if self.active else self.compute

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        self.active.append(s)
        try:
            yield
        finally:
            self.active.pop()


def make_handler(kind: str = "layer_first", strategy: str | None = None):
    layout = KVLayout(KVGeometry(2, 2, 4, 4, torch.bfloat16), kind)
    gpu = layout.allocate(12)
    for t in gpu:
        t.view(torch.int16).random_(-(1 << 15), 1 << 15)
    pool = HostPool(layout, 6)
    api = FakeStreamAPI()
    handler = CudaStreamTransferHandler(GpuCpuJobPlanner(gpu, layout, pool), api, strategy)
    return layout, gpu, pool, api, handler


def store(gpu: list[int], slots: list[int]) -> TransferSpec:
    return TransferSpec(GPULoadStoreSpec(gpu), CPULoadStoreSpec(slots))


def load(slots: list[int], gpu: list[int]) -> TransferSpec:
    return TransferSpec(CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu))


def test_streams_are_dedicated_low_priority_and_wait_for_compute() -> None:
    _layout, _gpu, _pool, api, handler = make_handler()
    handler.submit(1, store([0, 1], [0, 1]))
    handler.submit(2, load([0], [5]))
    s_store, s_load = handler._streams["store"], handler._streams["load"]
    assert s_store is not s_load and s_store is not api.compute
    assert s_store.priority == s_load.priority == TRANSFER_STREAM_PRIORITY == 0
    assert s_store.waited_on == [api.compute] and s_load.waited_on == [api.compute]
    assert len(s_store.events) == 1 and len(s_load.events) == 1


def test_an_expedited_load_does_not_queue_behind_the_other_loads() -> None:
    _layout, _gpu, _pool, api, handler = make_handler()
    handler.submit(1, load([0, 1], [2, 3]))
    handler.submit(2, load([2], [5]), expedited=True)
    handler.submit(3, store([6], [4]), expedited=True)  # only loads take the lane
    lanes = {name: len(s.events) for name, s in handler._streams.items()}
    assert lanes == {"store": 1, "load": 1, "expedited": 1}
    fast = handler._streams["expedited"]
    assert fast.waited_on == [api.compute] and fast.priority == TRANSFER_STREAM_PRIORITY
    fast.events[0].done = True
    assert [r.job_id for r in handler.get_finished()] == [2]  # the others still run


def test_results_only_after_the_event_completes() -> None:
    _layout, _gpu, _pool, _api, handler = make_handler()
    handler.submit(1, store([3, 4], [1, 2]))
    assert handler.get_finished() == []
    assert not handler.wait([1], timeout=0.01)
    handler._streams["store"].events[0].done = True
    (res,) = handler.get_finished()
    assert res.job_id == 1 and res.success and res.num_bytes > 0
    handler.submit(2, store([5], [3]))
    assert handler.wait([2, 99])  # synchronises; unknown ids are ignored
    assert [r.job_id for r in handler.get_finished()] == [2]


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("strategy", [None, "runs", "dst_runs", "src_runs", "staged"])
def test_round_trip_through_the_stream_path(kind: str, strategy: str | None) -> None:
    layout, gpu, _pool, _api, handler = make_handler(kind, strategy)
    before = [p.clone() for p in layout.block_planes(gpu)]
    handler.submit(1, store([7, 2, 9], [5, 0, 3]))
    handler.wait([1])
    handler.submit(2, load([5, 0, 3], [1, 11, 4]))
    handler.wait([2])
    assert all(r.success for r in handler.get_finished())
    for b, a in zip(before, layout.block_planes(gpu)):
        assert torch.equal(a[1], b[7]) and torch.equal(a[11], b[2]) and torch.equal(a[4], b[9])


def test_failures_bad_jobs_and_asynchronous_errors() -> None:
    _layout, _gpu, _pool, _api, handler = make_handler()
    handler.submit(1, store([1], [6]))
    (bad,) = handler.get_finished()
    assert not bad.success and "CPU slot id 6 out of range" in (bad.error or "")
    handler.submit(2, store([1], [0]))
    handler._streams["store"].events[-1].error = RuntimeError("CUDA error: an illegal address")
    (res,) = handler.get_finished()
    assert not res.success and res.num_bytes == 0
    assert res.error == "RuntimeError: CUDA error: an illegal address"
    handler.submit(3, store([2], [1]))
    with pytest.raises(ValueError, match="already in use"):
        handler.submit(3, store([2], [1]))
    handler.close()
    with pytest.raises(RuntimeError, match="closed"):
        handler.submit(4, store([2], [1]))


# -- real CUDA ------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_round_trip_is_bit_identical(kind: str, dtype: torch.dtype) -> None:
    layout = KVLayout(KVGeometry(3, 2, 16, 8, dtype), kind)
    gpu = layout.allocate(64, device="cuda")
    for t in gpu:
        t.view(torch.uint8).random_()
    pool = HostPool(layout, 32)
    assert pool.pinned
    worker = OffloadingWorker.for_cpu_tier(gpu, layout, pool)
    assert isinstance(worker.handlers[("GPU", "CPU")], CudaStreamTransferHandler)
    rng = np.random.default_rng(0)
    src = rng.choice(64, 24, replace=False).tolist()
    slots = rng.choice(32, 24, replace=False).tolist()
    before = [p.cpu() for p in layout.block_planes(gpu)]
    worker.submit_store(1, store(src, slots))
    worker.wait([1])
    for t in gpu:
        t.zero_()
    targets = rng.choice(64, 24, replace=False).tolist()
    worker.submit_load(2, load(slots, targets))
    worker.wait([2])
    results = worker.get_finished()
    assert all(r.success for r in results), [r.error for r in results]
    torch.cuda.synchronize()
    for b, a in zip(before, layout.block_planes(gpu)):
        a = a.cpu()
        for s, d in zip(src, targets):
            assert torch.equal(a[d], b[s])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize(
    ("direction", "strategy"),
    [("store", "runs"), ("store", "dst_runs"), ("load", "runs"), ("load", "src_runs")],
)
def test_cuda_cross_device_strategies(direction: str, strategy: str) -> None:
    layout = KVLayout(KVGeometry(2, 2, 8, 4, torch.float16), "layer_first")
    gpu = layout.allocate(16, device="cuda")
    for t in gpu:
        t.view(torch.uint8).random_()
    pool = HostPool(layout, 16)
    for t in pool.tensors:
        t.view(torch.uint8).random_()
    handler = CudaStreamTransferHandler(GpuCpuJobPlanner(gpu, layout, pool), strategy=strategy)
    gpu_ids, slots = [3, 9, 1, 12], [7, 0, 15, 2]
    if direction == "store":
        handler.submit(1, store(gpu_ids, slots))
    else:
        handler.submit(1, load(slots, gpu_ids))
    handler.wait([1])
    (res,) = handler.get_finished()
    assert res.success, res.error
    torch.cuda.synchronize()
    for gp, hp in zip(layout.block_planes(gpu), pool.planes):
        for g, s in zip(gpu_ids, slots):
            assert torch.equal(gp[g].cpu(), hp[s])


@needs_cuda
@pytest.mark.cuda
def test_cuda_bad_job_reports_failure() -> None:
    layout = KVLayout(KVGeometry(1, 1, 8, 4, torch.float16))
    gpu = layout.allocate(4, device="cuda")
    worker = OffloadingWorker.for_cpu_tier(gpu, layout, HostPool(layout, 2))
    worker.submit_store(1, store([0, 7], [0, 1]))
    worker.wait([1])
    (res,) = worker.get_finished()
    assert not res.success and "GPU block id 7" in (res.error or "")
