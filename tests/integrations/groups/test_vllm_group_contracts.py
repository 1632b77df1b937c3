"""Contracts of ``groups/group_slots`` and ``groups/group_kinds`` that their docstrings state.

- ``windowed_groups``: every kind that keeps only a window of a prefix (sliding window,
  MLA + sliding window, chunked local, Mamba in each cache mode) is windowed; full
  attention, MLA and drafter groups are not; without kinds the windows decide.
- ``plan_group_slots``: windowed groups share the widest full group's slots, so a full
  group keeps all of the budget's chunks whatever the Mamba groups' layer counts.
- ``group_layouts``: the chunk-unit policy is told each kind (Mamba: its state only).
- ``group_kinds``: each layer spec's kind and window as ``describe_groups`` hands them on;
  a group in host memory is refused in one line naming it.
"""

from tests.vllm_required import need_vllm

need_vllm()

from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from kvoffload.integrations.vllm.groups.group_kinds import (  # noqa: E402
    check_offloadable,
    describe_groups,
    group_kind,
    group_layouts,
    unsupported_group,
)
from kvoffload.integrations.vllm.groups.group_slots import (  # noqa: E402
    plan_group_slots,
    windowed_groups,
)
from kvoffload.integrations.vllm.settings import KVOffloadConfigError  # noqa: E402
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


# -- group_kinds: what vLLM's specs are called, and the one-line refusals ---------------


def _kcc(groups: list[tuple[list[str], Any]], host: int | None = None) -> Any:
    """What ``group_kinds`` reads of vLLM's ``KVCacheConfig``: its groups, in order."""
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                layer_names=names, kv_cache_spec=spec, is_eagle_group=False, host_resident=i == host
            )
            for i, (names, spec) in enumerate(groups)
        ]
    )


def test_each_spec_is_named_and_described_with_its_window() -> None:
    from tests.integrations.vllm_groups_rig import (
        chunked_spec,
        draft_spec,
        full_spec,
        mamba_spec,
        mla_sliding_spec,
        mla_spec,
        sliding_spec,
    )

    specs = [full_spec(), sliding_spec(32), chunked_spec(64), mamba_spec(), mla_spec(),
             mla_sliding_spec(48), draft_spec()]  # fmt: skip
    kcc = _kcc([([f"l{i}"], s) for i, s in enumerate(specs)])
    described = [(gid, kind, window) for gid, kind, window in describe_groups(kcc)]
    assert described == [
        (0, "full_attention", None),
        (1, "sliding_window", 32),
        (2, "chunked_local", 64),
        (3, "mamba_align", None),
        (4, "mla", None),
        (5, "mla_sliding_window", 48),
        (6, "drafter", None),
    ]
    assert group_kind(full_spec(), is_eagle_group=True) == "drafter"
    assert unsupported_group(kcc) is None


def test_a_group_in_host_memory_is_refused_in_one_line_naming_it() -> None:
    from tests.integrations.vllm_groups_rig import full_spec, sliding_spec

    kcc = _kcc([(["a"], full_spec()), (["b"], sliding_spec(32))], host=1)
    with pytest.raises(KVOffloadConfigError) as info:
        check_offloadable(kcc)
    text = str(info.value)
    assert "group 1" in text and "host memory" in text and "\n" not in text
