"""Contracts of ``groups/group_slots`` and ``groups/group_kinds`` that their docstrings state.

- ``windowed_groups``: every kind that keeps only a window of a prefix (sliding window,
  MLA + sliding window, chunked local, Mamba in each cache mode) is windowed; full
  attention, MLA and drafter groups are not; without kinds the windows decide.
- ``plan_group_slots``: windowed groups share the widest full group's slots, so a full
  group keeps all of the budget's chunks whatever the Mamba groups' layer counts.
- ``group_layouts``: the chunk-unit policy is told each kind (Mamba: its state only).
"""

from tests.vllm_required import need_vllm

need_vllm()

from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from kvoffload.integrations.vllm.groups.group_kinds import group_layouts  # noqa: E402
from kvoffload.integrations.vllm.groups.group_slots import (  # noqa: E402
    plan_group_slots,
    windowed_groups,
)
from kvoffload.offload.chunk_units import (  # noqa: E402
    CHUNKED_LOCAL,
    FULL_ATTENTION,
    MAMBA,
    SLIDING_WINDOW,
)

PAGE = 2048
MAMBA_KINDS = ("mamba_align", "mamba_all", "mamba_none")
WINDOWED = ("sliding_window", "mla_sliding_window", "chunked_local", *MAMBA_KINDS)
WHOLE = ("full_attention", "mla", "drafter")


def config(layers: list[int], windows: list[int | None] | None = None) -> Any:
    """What ``group_slots`` reads of vLLM's ``OffloadingConfig`` (a layer-outermost layout)."""
    groups = []
    for g, n in enumerate(layers):
        group = SimpleNamespace(
            group_id=g, tokens_per_block=16, layer_names=tuple(f"g{g}.l{i}" for i in range(n))
        )
        if windows is not None:
            group.sliding_window_size_in_chunks = windows[g]
        groups.append(group)
    return SimpleNamespace(
        groups=tuple(groups),
        worker_kv_bytes_per_block=max(layers) * PAGE,
        parallel=SimpleNamespace(world_size=1),
        kv_cache_layout="LBHNC",
        cache=SimpleNamespace(blocks_per_chunk=1),
    )


@pytest.mark.parametrize("kind", WINDOWED + WHOLE)
def test_each_kind_is_windowed_exactly_when_it_keeps_a_window(kind: str) -> None:
    described = [(0, "full_attention", None), (1, kind, 64)]
    assert windowed_groups(config([4, 4]), described) == [False, kind in WINDOWED]


def test_without_kinds_the_windows_decide_and_without_windows_nothing_is_known() -> None:
    assert windowed_groups(config([4, 4], [None, 4]), None) == [False, True]
    assert windowed_groups(config([4, 4]), None) is None


@pytest.mark.parametrize("mamba", MAMBA_KINDS)
def test_mamba_groups_of_fewer_layers_leave_the_full_group_the_whole_budget(mamba: str) -> None:
    # One 4-layer full-attention group, three 2-layer Mamba groups (a Granite 4 style hybrid).
    cfg = config([4, 2, 2, 2])
    described = [(0, "full_attention", None)] + [(g, mamba, None) for g in (1, 2, 3)]
    windowed = windowed_groups(cfg, described)
    budget = 100 * 4 * PAGE
    plan = plan_group_slots(cfg, budget, 1, windowed=windowed)
    assert plan.single
    assert plan.classes[0].num_slots == 100  # every chunk of the budget for the full group


@pytest.mark.parametrize(
    ("kind", "window", "want"),
    [
        ("full_attention", None, (FULL_ATTENTION, None)),
        ("mla", None, (FULL_ATTENTION, None)),
        ("drafter", None, (FULL_ATTENTION, None)),
        ("sliding_window", 48, (SLIDING_WINDOW, 48)),
        ("mla_sliding_window", 48, (SLIDING_WINDOW, 48)),
        ("chunked_local", 64, (CHUNKED_LOCAL, 64)),
        *[(m, None, (MAMBA, None)) for m in MAMBA_KINDS],
    ],
)
def test_the_policy_is_told_each_kind(kind: str, window: int | None, want: tuple) -> None:
    described = [(0, "full_attention", None), (1, kind, window)]
    layout = group_layouts(config([4, 4]), described, [PAGE, PAGE])
    assert [(g.kind, g.sliding_window) for g in layout] == [(FULL_ATTENTION, None), want]
    assert [g.slot_bytes for g in layout] == [PAGE, PAGE]


def test_behind_the_stock_connector_the_windows_become_sliding_windows() -> None:
    layout = group_layouts(config([4, 4], [None, 3]), None, [PAGE, PAGE])
    assert [(g.kind, g.sliding_window) for g in layout] == [
        (FULL_ATTENTION, None),
        (SLIDING_WINDOW, 3 * 16),
    ]
