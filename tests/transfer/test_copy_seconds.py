"""A thread-pool job reports how long its copies ran (``TransferResult.copy_seconds``).

vLLM's metric turns a load's time into GB/s; a staged load's time from submit
to done spans the forward pass it is copied under, so the job also says how
long its parts ran (wall, added over parts) and their threads' CPU time.
"""

from __future__ import annotations

import numpy as np
import torch

from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import HostPool, KVGeometry, KVLayout, OffloadingWorker, TransferSpec


def test_every_job_reports_its_copies_wall_and_cpu_time() -> None:
    layout = KVLayout(KVGeometry(2, 2, 64, 16, torch.float16), "layer_first")
    gpu = layout.allocate(16)
    host = HostPool(layout, 16)
    ids = np.arange(8)
    store = TransferSpec(GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))
    load = TransferSpec(CPULoadStoreSpec(ids), GPULoadStoreSpec(ids))
    row = layout.plane_row_bytes
    stages = [[(p, 0, row)] for p in range(layout.num_planes)]
    with OffloadingWorker.for_cpu_tier(gpu, layout, host, num_threads=2) as worker:
        worker.submit_store(1, store)
        worker.wait([1])
        worker.submit_load(2, load, expedited=True)
        worker.wait([2])
        worker.submit_load(3, load, True, stages)
        worker.wait([3])
        results = {r.job_id: r for r in worker.get_finished()}
    assert sorted(results) == [1, 2, 3]
    for r in results.values():
        assert r.success and r.copy_seconds is not None and r.copy_cpu_seconds is not None
        assert r.copy_seconds >= 0 and r.copy_cpu_seconds >= 0
