"""kvoffload with several KV cache groups inside vLLM 0.33's real scheduler (hybrid models).

The layouts come from vLLM's own planner; see ``vllm_groups_rig``. Each test
serves a prompt, pushes it out of the GPU tier with unrelated prompts and
serves it again: the returning request must load every group's blocks from
kvoffload's CPU tier, byte for byte what each group's layers held.
"""

from tests.vllm_required import need_vllm

need_vllm()

import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.integrations import vllm_groups_rig as groups_rig  # noqa: E402
from tests.integrations.vllm_groups_rig import (  # noqa: E402
    KVOFFLOAD_SPEC,
    STOCK,
    GroupsRig,
    draft_spec,
    full_spec,
    layer_specs,
    sliding_spec,
    vllm_cpu_reference,
)
from tests.integrations.vllm_rig import CONNECTOR  # noqa: E402

PROMPT = list(range(1, 129))  # 8 full blocks of 16 tokens


def serve_evict_return(rig: GroupsRig, n_flood: int = 3) -> None:
    groups_rig.serve_evict_return(rig, PROMPT, n_flood)


@pytest.mark.parametrize("connector", ["KVOffloadConnector", "OffloadingConnector"])
def test_sliding_window_and_full_attention_groups_load_every_groups_bytes(
    tmp_path: Path, connector: str
) -> None:
    specs = layer_specs([full_spec(), sliding_spec(32), full_spec(), sliding_spec(32)])
    extra: dict = {"cpu_bytes": "4MiB"}
    conn = CONNECTOR
    if connector == "OffloadingConnector":
        conn, extra = STOCK, {**extra, **KVOFFLOAD_SPEC}
    rig = GroupsRig.build(tmp_path / "kvoffload", specs, extra, conn)
    assert len(rig.groups) == 2
    serve_evict_return(rig)
    reference = vllm_cpu_reference(tmp_path / "vllm", specs, 4 << 20)
    serve_evict_return(reference)
    assert rig.first_computed["again"] == reference.first_computed["again"] > 0
    assert sorted(rig.stored_keys) == sorted(reference.stored_keys)
    assert sorted(rig.loaded_keys) == sorted(reference.loaded_keys)
    assert {int.from_bytes(k[-4:], "big") for k in rig.loaded_keys} == {0, 1}
    assert not rig.mismatches
    assert rig.blocks_verified == len(rig.loaded_keys) and rig.bytes_verified > 0
    rig.shutdown()
    reference.shutdown()


def test_a_group_with_fewer_layers_gets_slots_of_its_own_size(tmp_path: Path) -> None:
    # vLLM's planner: [full + drafter] (2 layers), [full] (1 layer), [sliding x2]. The
    # one-layer full-attention group needs every chunk too: slots of one page of its own.
    kinds = [full_spec(), full_spec(), sliding_spec(32), sliding_spec(32), draft_spec()]
    rig = GroupsRig.build(
        tmp_path / "kvoffload", layer_specs(kinds), {"cpu_bytes": "4MiB"}, CONNECTOR
    )
    assert [len(g.layer_names) for g in rig.groups] == [2, 1, 2]
    spec = rig.worker_connector.connector_worker.spec
    plan = spec.slot_plan
    assert [c.groups for c in plan.classes] == [(0, 2), (1,)]
    page = rig.kv_caches["model.layers.0.self_attn.attn"][0].numel() * 2
    assert [plan.slot_bytes(c) for c in range(2)] == [2 * page, page]
    # cpu_bytes split so that every full-attention group can hold the same number of
    # chunks; the sliding-window group shares the wider class's slots.
    assert abs(plan.classes[0].num_slots - plan.classes[1].num_slots) <= 1
    total = sum(c.num_slots * plan.slot_bytes(i) for i, c in enumerate(plan.classes))
    assert total <= 4 << 20 < total + 3 * 2 * page
    worker = rig.worker_connector.connector_worker.worker
    pools = {id(p): p for _, _, p in worker.group_pools}
    assert sorted(p.slot_bytes for p in pools.values()) == [page, 2 * page]
    serve_evict_return(rig)
    reference = vllm_cpu_reference(tmp_path / "vllm", layer_specs(kinds), 4 << 20)
    serve_evict_return(reference)
    assert rig.first_computed["again"] == reference.first_computed["again"] > 0
    assert sorted(rig.stored_keys) == sorted(reference.stored_keys)
    assert sorted(rig.loaded_keys) == sorted(reference.loaded_keys)
    assert {int.from_bytes(k[-4:], "big") for k in rig.loaded_keys} == {0, 1, 2}
    assert not rig.mismatches
    assert rig.blocks_verified == len(rig.loaded_keys)
    rig.shutdown()
    reference.shutdown()


def test_sliding_window_groups_with_a_disk_tier_below_the_cpu_tier(tmp_path: Path) -> None:
    # Lower tiers: vLLM's tiering manager, its CPU tier in the shared region (one row
    # size for every group, as vLLM's), kvoffload's disk tier below. A CPU tier of
    # a few rows pushes the prompt down to disk; it comes back through the CPU rows.
    specs = layer_specs([full_spec(), sliding_spec(32), full_spec(), sliding_spec(32)])
    extra = {"cpu_bytes": "256KiB", "disk_dir": str(tmp_path / "disk"), "disk_bytes": "64MiB"}
    rig = GroupsRig.build(tmp_path / "kvoffload", specs, extra, CONNECTOR)
    spec = rig.worker_connector.connector_worker.spec
    assert spec.tiered and spec.slot_plan.single
    serve_evict_return(rig, n_flood=4)
    assert rig.first_computed["again"] > 0
    assert {int.from_bytes(k[-4:], "big") for k in rig.loaded_keys} == {0, 1}
    assert not rig.mismatches and rig.blocks_verified == len(rig.loaded_keys)
    assert any((tmp_path / "disk").rglob("*")), "nothing reached the disk tier"
    rig.shutdown()


@pytest.mark.parametrize("lower", [{}, {"disk_bytes": "64MiB"}], ids=["cpu-tier", "disk-tier"])
@pytest.mark.parametrize("layout", ["sliding_window", "drafter"])
def test_chunks_of_two_gpu_blocks_per_group_match_vllm(
    tmp_path: Path, layout: str, lower: dict
) -> None:
    # An offloaded chunk of 2 GPU blocks: a group's first block may sit in the middle of
    # its first chunk (vLLM's block_indices), and sliding-window groups skip chunks.
    # A window of 3 GPU blocks: a load of that group starts inside a chunk.
    kinds = [full_spec(), sliding_spec(48), full_spec(), sliding_spec(48)]
    if layout == "drafter":  # two slot classes (a one-layer full-attention group)
        kinds = [full_spec(), full_spec(), sliding_spec(48), sliding_spec(48), draft_spec()]
    extra: dict = {"cpu_bytes": "4MiB", "blocks_per_chunk": 2, **lower}
    if lower:
        extra["disk_dir"] = str(tmp_path / "disk")
    rig = GroupsRig.build(tmp_path / "kvoffload", layer_specs(kinds), extra, CONNECTOR)
    serve_evict_return(rig)
    rig.add([*PROMPT[:72], *range(900, 956)], "part")
    rig.run()
    reference = vllm_cpu_reference(
        tmp_path / "vllm", layer_specs(kinds), 4 << 20, blocks_per_chunk=2
    )
    serve_evict_return(reference)
    reference.add([*PROMPT[:72], *range(900, 956)], "part")
    reference.run()
    assert rig.first_computed == reference.first_computed
    assert rig.first_computed["again"] > 0
    assert sorted(rig.stored_keys) == sorted(reference.stored_keys)
    assert sorted(rig.loaded_keys) == sorted(reference.loaded_keys)
    assert not rig.mismatches and rig.blocks_verified > 0
    # Some job started a group in the middle of its first chunk.
    assert any(
        n and first % 2 for sizes, firsts in rig.job_groups for n, first in zip(sizes, firsts)
    )
    rig.shutdown()
    reference.shutdown()


def test_windowed_groups_of_fewer_layers_share_the_widest_slots(tmp_path: Path) -> None:
    # Gemma style: [full x2], [sliding x2], [sliding x1]: the windowed remainder group holds
    # a few chunks per prefix; it shares the full groups' slots (padded, as vLLM's) rather
    # than take a share of cpu_bytes it would mostly leave empty.
    kinds = [full_spec(), sliding_spec(32), sliding_spec(32), full_spec(), sliding_spec(32)]
    rig = GroupsRig.build(tmp_path, layer_specs(kinds), {"cpu_bytes": "4MiB"}, CONNECTOR)
    assert [len(g.layer_names) for g in rig.groups] == [2, 2, 1]
    assert rig.worker_connector.connector_worker.spec.slot_plan.single
    rig.shutdown()


def test_the_start_up_line_gives_bytes_per_slot_per_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kinds = [full_spec(), full_spec(), sliding_spec(32), sliding_spec(32), draft_spec()]
    with caplog.at_level(logging.INFO, logger="vllm.kvoffload"):
        rig = GroupsRig.build(tmp_path, layer_specs(kinds), {"cpu_bytes": "3MiB"}, CONNECTOR)
    lines = [r.getMessage() for r in caplog.records if "kvoffload: CPU tier of" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)
    assert "[group 0 (2 layers), group 2 (2 layers)]: 512 slots of 4KiB" in lines[-1]
    assert "[group 1 (1 layers)]: 512 slots of 2KiB" in lines[-1]
    rig.shutdown()
