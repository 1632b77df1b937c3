"""``dst_runs`` on one device gathers plane by plane where a job's destination is a few runs.

A fused ``[planes, blocks, row]`` group's slice is strided, so ``index_select``
into it copies element by element; a store into CPU slots handed out in runs
(``test_slot_runs``) instead gathers each plane's rows by ``memcpy``
(measured single-threaded on 1,000 64 KiB blocks in request chains: 0.61 of a
bulk copy fused, 0.85 plane by plane).
"""

from __future__ import annotations

import numpy as np
import torch

from kvoffload.transfer.copy_plan import GroupPairs, RowPairs, _dst_runs_cost, copy_rows
from kvoffload.transfer.layout import KVGeometry, KVLayout
from tests.transfer.test_copy_plan import random_fill, reference_copy


def _rig(blocks: int) -> tuple[KVLayout, list[torch.Tensor], list[torch.Tensor]]:
    layout = KVLayout(KVGeometry(2, 2, 64, 16, torch.float16), "layer_first")
    src, dst = layout.allocate(blocks), layout.allocate(blocks)
    random_fill(src, 1)
    random_fill(dst, 2)
    return layout, src, dst


def test_a_few_long_destination_runs_are_gathered_plane_by_plane() -> None:
    layout, src, dst = _rig(256)
    groups = GroupPairs(layout, src, dst)
    assert len(groups.narrow) == 1 and groups.narrow[0][0].shape[0] == 4  # fused, strided
    src_rows = np.random.default_rng(0).permutation(256)[:200]
    dst_rows = np.concatenate([np.arange(10, 110), np.arange(150, 250)])
    pairs = RowPairs.build(src_rows, dst_rows)
    split = groups.plane_split
    assert split is not None and len(split) == 4
    assert _dst_runs_cost(pairs, groups)[1] is split
    expected = reference_copy(layout, src, dst, src_rows.tolist(), dst_rows.tolist())
    assert copy_rows(groups, pairs, "dst_runs") == "dst_runs"
    for got, want in zip(dst, expected):
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_scattered_destinations_keep_the_fused_gather() -> None:
    layout, src, dst = _rig(256)
    groups = GroupPairs(layout, src, dst)
    rng = np.random.default_rng(1)
    pairs = RowPairs.build(rng.permutation(256)[:100], rng.permutation(256)[:100])
    assert _dst_runs_cost(pairs, groups)[1] is groups.narrow


def test_narrowed_pairs_do_not_keep_the_whole_groups_split() -> None:
    layout, src, dst = _rig(8)
    groups = GroupPairs(layout, src, dst)
    assert groups.plane_split is not None and len(groups.plane_split) == 4
    layer = groups.whole_planes([(2, 0, layout.plane_row_bytes), (3, 0, layout.plane_row_bytes)])
    assert layer is not None
    assert layer.plane_split is not None and len(layer.plane_split) == 2
    assert groups.spans([(0, 0, 8)]).plane_split is None  # one plane per group already
