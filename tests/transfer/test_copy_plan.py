"""Row copy strategies against a per-row reference copy; run detection; strategy choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.transfer.copy_plan import (
    STRATEGIES,
    GroupPairs,
    RowPairs,
    choose_strategy,
    copy_rows,
)
from kvoffload.transfer.layout import LAYOUT_KINDS, KVGeometry, KVLayout


def random_fill(tensors: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def reference_copy(
    layout: KVLayout,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_rows: list[int],
    dst_rows: list[int],
) -> list[torch.Tensor]:
    out = [t.clone() for t in dst]
    for sp, dp in zip(layout.block_planes(src), layout.block_planes(out)):
        for s, d in zip(src_rows, dst_rows):
            dp[d] = sp[s]
    return out


def test_row_pairs_runs() -> None:
    pairs = RowPairs.build(np.array([5, 6, 7, 1, 9, 2]), np.array([10, 11, 12, 0, 13, 1]))
    # Sorted by destination: 0<-1, 1<-2, 10<-5, 11<-6, 12<-7, 13<-9.
    assert pairs.dst_rows.tolist() == [0, 1, 10, 11, 12, 13]
    assert pairs.src_rows.tolist() == [1, 2, 5, 6, 7, 9]
    assert pairs.run_starts.tolist() == [0, 2, 5]
    assert pairs.dst_run_starts.tolist() == [0, 2]
    assert pairs.src_rows[pairs.by_src].tolist() == [1, 2, 5, 6, 7, 9]
    assert pairs.src_run_starts.tolist() == [0, 2, 5]
    assert pairs.slice(2, 5).dst_rows.tolist() == [10, 11, 12]


def test_row_pairs_rejects_duplicate_destinations_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="destination block 3 appears more than once"):
        RowPairs.build(np.array([0, 1]), np.array([3, 3]))
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        RowPairs.build(np.array([0, 1]), np.array([3]))
    RowPairs.build(np.array([4, 4]), np.array([0, 1]))  # a repeated source is fine


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(LAYOUT_KINDS),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
    head_size=st.sampled_from([1, 3, 4]),
    strategy=st.sampled_from([None, *STRATEGIES]),
    fused=st.booleans(),
    data=st.data(),
)
def test_every_strategy_matches_the_reference(
    kind, dtype, head_size, strategy, fused, data
) -> None:
    layout = KVLayout(KVGeometry(2, 2, head_size, 2, dtype), kind)
    num_src, num_dst = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    src, dst = layout.allocate(num_src), layout.allocate(num_dst)
    if not fused:  # separately allocated tensors cannot be fused into one group
        src = [t.clone() for t in src]
    random_fill(src, 1)
    random_fill(dst, 2)
    n = data.draw(st.integers(0, num_dst))
    dst_rows = data.draw(st.permutations(range(num_dst)))[:n]
    src_rows = data.draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
    expected = reference_copy(layout, src, dst, src_rows, dst_rows)
    pairs = RowPairs.build(np.array(src_rows, dtype=np.int64), np.array(dst_rows, dtype=np.int64))
    copy_rows(GroupPairs(layout, src, dst), pairs, strategy)
    for got, want in zip(dst, expected):
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_choose_strategy_prefers_few_calls() -> None:
    layout = KVLayout(KVGeometry(1, 1, 64, 16, torch.float16), "cross_layer")
    groups = GroupPairs(layout, layout.allocate(64), layout.allocate(64))
    one_run = RowPairs.build(np.arange(10, 40), np.arange(0, 30))
    assert choose_strategy(one_run, groups) == "runs"
    dst_consecutive = RowPairs.build(np.random.default_rng(0).permutation(64)[:30], np.arange(30))
    assert choose_strategy(dst_consecutive, groups) == "dst_runs"
    src_consecutive = RowPairs.build(np.arange(30), np.random.default_rng(0).permutation(64)[:30])
    assert choose_strategy(src_consecutive, groups) == "src_runs"


def test_unknown_strategy_is_an_error() -> None:
    layout = KVLayout(KVGeometry(1, 1, 4, 1, torch.float32))
    groups = GroupPairs(layout, layout.allocate(2), layout.allocate(2))
    with pytest.raises(ValueError, match="unknown copy strategy"):
        copy_rows(groups, RowPairs.build(np.array([0]), np.array([1])), "teleport")


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_runs_views_cross_chunk_boundaries_and_repeated_sources(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Row views are made a chunk at a time and long runs are split out in one call; a source
    row copied twice makes overlapping source runs (sliced one by one)."""
    import kvoffload.transfer.row_views as row_views

    monkeypatch.setattr(row_views, "CHUNK_ROWS", chunk)
    layout = KVLayout(KVGeometry(2, 1, 4, 2, torch.float16), "layer_first")
    src, dst = layout.allocate(20), layout.allocate(20)
    random_fill(src, 3)
    random_fill(dst, 4)
    src_rows = [7, 8, 9, 7, 8, 9, 0, 19, 4, 12]
    dst_rows = [0, 1, 2, 5, 6, 7, 19, 3, 11, 12]
    expected = reference_copy(layout, src, dst, src_rows, dst_rows)
    groups = GroupPairs(layout, src, dst)
    pairs = RowPairs.build(np.array(src_rows), np.array(dst_rows))
    for _ in range(2):  # the second copy reuses the cached views
        copy_rows(groups, pairs, "runs")
        for got, want in zip(dst, expected):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
