"""Per-group CPU slots (``group_slots``), the multi-class CPU tier (``class_managers``) and the
one-line refusal of KV cache group kinds vLLM's offloading does not take (``group_kinds``)."""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)

from kvoffload.integrations.vllm import KVOffloadConfigError, KVOffloadConnector  # noqa: E402
from kvoffload.integrations.vllm.groups.group_kinds import check_offloadable, group_kind  # noqa: E402
from kvoffload.integrations.vllm.groups.group_slots import (  # noqa: E402
    group_layout_fingerprint,
    plan_group_slots,
)
from kvoffload.integrations.vllm.scheduler.class_managers import ClassedCPUManager  # noqa: E402
from kvoffload.offload import CPUOffloadingManager  # noqa: E402
from tests.integrations.vllm_groups_rig import (  # noqa: E402
    KINDS,
    GroupsRig,
    full_spec,
    layer_specs,
)
from tests.integrations.vllm_rig import CONNECTOR  # noqa: E402
from tests.integrations.vllm_tier_rig import parallel_config  # noqa: E402

PAGE = 2048


def config(layers: list[int], layout: str | None = "LBHNC", world: int = 1) -> OffloadingConfig:
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=16,
            layer_names=tuple(f"g{g}.l{i}" for i in range(n)),
            group_id=g,
        )
        for g, n in enumerate(layers)
    )
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=max(layers) * PAGE,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=OffloadingModelConfig(name="m", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel_config(world),
        kv_cache_layout=layout,
    )


@pytest.mark.parametrize("world", [1, 2])
def test_full_attention_groups_of_fewer_layers_get_smaller_slots_and_as_many_chunks(
    world: int,
) -> None:
    # [full x4], [sliding x4] x3, [full x1] (e.g. an MTP / EAGLE drafter layer).
    layers = [4, 4, 4, 4, 1]
    windowed = [False, True, True, True, False]
    budget = 100 * 5 * PAGE * world
    plan = plan_group_slots(config(layers, world=world), budget, 1, windowed=windowed)
    assert [c.groups for c in plan.classes] == [(0, 1, 2, 3), (4,)]
    assert [plan.slot_bytes(c) for c in range(2)] == [4 * PAGE, PAGE]
    # Both full-attention groups can hold 100 chunks; the sliding-window groups share
    # the wide slots. Nothing of the one-layer group is padded to four pages.
    assert [c.num_slots for c in plan.classes] == [100, 100]
    used = sum(c.num_slots * plan.slot_bytes(i) * world for i, c in enumerate(plan.classes))
    assert used == budget
    line = plan.describe([f"g{g}" for g in range(len(layers))])
    per_slot = "2KiB" if world == 1 else "4KiB"  # all workers' shards of one slot
    assert "\n" not in line and f"[g4]: 100 slots of {per_slot}" in line


def test_windowed_groups_of_fewer_layers_share_the_full_groups_slots() -> None:
    # Gemma 3 1B style: 4 full layers, 22 sliding: vLLM's groups of 4, 4, 4, 4, 4, 4, 2.
    layers = [4, 4, 4, 4, 4, 4, 2]
    windowed = [False] + [True] * 6
    plan = plan_group_slots(config(layers), 64 * 4 * PAGE, 1, windowed=windowed)
    assert plan.single and plan.classes[0].num_slots == 64


def test_a_budget_below_one_slot_of_a_class_is_refused_in_one_line() -> None:
    with pytest.raises(KVOffloadConfigError) as info:
        plan_group_slots(config([4, 1]), 4 * PAGE, 1, windowed=[False, False])
    assert "'cpu_bytes'" in str(info.value) and "\n" not in str(info.value)


def test_the_group_layout_fingerprint_tells_layouts_apart() -> None:
    prints = {group_layout_fingerprint(config(layers)) for layers in ([4, 4], [4, 2], [4], [2, 4])}
    assert len(prints) == 4


def key(block: int, group: int) -> bytes:
    return make_offload_key(block.to_bytes(32, "big"), group)


def test_classed_manager_keeps_each_class_in_its_own_slots_and_the_callers_order() -> None:
    m = ClassedCPUManager(
        [CPUOffloadingManager(4, "lru"), CPUOffloadingManager(2, "lru")], [0, 0, 1]
    )
    keys = [key(1, 0), key(1, 2), key(1, 1), key(2, 2), key(2, 0)]
    out = m.prepare_store(keys)
    assert out is not None and out.keys_to_store == keys
    slots = list(out.store_spec.block_ids)
    big, small = (
        [s for k, s in zip(keys, slots) if k[-1] != 2],
        [s for k, s in zip(keys, slots) if k[-1] == 2],
    )
    assert sorted(big) == [0, 1, 2] and sorted(small) == [0, 1]  # class-local slot ids
    m.complete_store(keys)
    assert all(m.is_stored(k) for k in keys) and m.lookup(keys) == 5
    load = m.prepare_load([key(2, 2), key(1, 0)])
    assert list(load.block_ids) == [m.slot_of(key(2, 2)), m.slot_of(key(1, 0))]
    m.complete_load([key(2, 2), key(1, 0)])
    # The small class is full: a third key evicts within it, never in the other class.
    out = m.prepare_store([key(3, 2)])
    assert out is not None and len(out.evicted_keys) == 1 and out.evicted_keys[0][-1] == 2
    assert m.num_stored_blocks() == 4
    with pytest.raises(ValueError, match="group 7"):
        m.is_stored(key(1, 7))


def test_a_store_one_class_refuses_leaves_no_key_storing_in_the_others() -> None:
    m = ClassedCPUManager([CPUOffloadingManager(4, "lru"), CPUOffloadingManager(1, "lru")], [0, 1])
    pinned = key(9, 1)
    m.complete_store(m.prepare_store([pinned]).keys_to_store)
    m.prepare_load([pinned])  # the small class's only slot is pinned
    assert m.prepare_store([key(1, 0), key(1, 1)]) is None
    assert not m.is_storing(key(1, 0)) and not m.is_stored(key(1, 0))
    assert m.managers[0].num_free_blocks() == 4


def cross_attention_config() -> KVCacheConfig:
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["decoder.0"], full_spec()),
            KVCacheGroupSpec(["cross.0"], cross),
        ],
    )


def test_a_kind_vllms_offloading_refuses_is_refused_in_one_line_naming_it() -> None:
    kcc = cross_attention_config()
    # vLLM's own offloading config asserts on it (no message).
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks,
    )

    with pytest.raises(AssertionError):
        get_sliding_window_size_in_chunks(kcc.kv_cache_groups[1].kv_cache_spec, 16)
    with pytest.raises(KVOffloadConfigError) as info:
        check_offloadable(kcc)
    text = str(info.value)
    assert "CrossAttentionSpec" in text and "group 1" in text and "\n" not in text


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_supported_kind_is_accepted_and_named(kind: str) -> None:
    names = {group_kind(spec) for spec in KINDS[kind]()}
    assert not any(n.startswith("unsupported") for n in names)


def test_kvoffload_connector_supports_vllms_hybrid_allocator(tmp_path: Path) -> None:
    assert supports_hma(KVOffloadConnector)
    assert "request_finished_all_groups" in dir(KVOffloadConnector)
    # Built with HMA on and two groups: vLLM's factory accepts it.
    specs: dict[str, Any] = layer_specs(KINDS["sliding_window"]())
    rig = GroupsRig.build(tmp_path, specs, {"cpu_bytes": "1MiB"}, CONNECTOR)
    assert rig.config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert len(rig.groups) == 2
    rig.shutdown()


def test_kvoffload_connector_refuses_such_a_model_at_start_up_in_one_line(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.integrations.vllm_rig import vllm_config, write_tiny_llama

    cfg = vllm_config(write_tiny_llama(tmp_path / "m"), 8, {"cpu_bytes": "1MiB"})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(KVOffloadConfigError, match="CrossAttentionSpec") as info:
            KVOffloadConnector(cfg, role, cross_attention_config())
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kind", "connector", "want"),
    [
        ("chunked_local", "kvoffload", [("full_attention", None), ("chunked_local", 64)]),
        ("mamba_align", "kvoffload", [("full_attention", None)] + [("mamba", None)] * 3),
        # vLLM's stock connector tells the spec only the windows (in chunks of 16 tokens).
        ("chunked_local", "stock", [("full_attention", None), ("sliding_window", 64)]),
    ],
)
def test_the_cpu_tiers_policy_knows_each_groups_kind_and_window(
    tmp_path: Path, kind: str, connector: str, want: list
) -> None:
    extra: dict[str, Any] = {"cpu_bytes": "1MiB"}
    conn = CONNECTOR
    if connector == "stock":
        conn = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
        extra.update(spec_name="KVOffloadSpec", spec_module_path="kvoffload.integrations.vllm")
    rig = GroupsRig.build(tmp_path, layer_specs(KINDS[kind]()), extra, conn, instant=True)
    layout = rig.scheduler.connector.connector_scheduler.manager.cpu.group_layout
    assert [(g.kind, g.sliding_window) for g in layout] == want
    assert {g.tokens_per_chunk for g in layout} == {16}
    rig.shutdown()
