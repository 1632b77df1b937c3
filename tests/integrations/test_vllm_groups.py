"""kvoffload with several KV cache groups inside vLLM 0.33's real scheduler (hybrid models).

The layouts come from vLLM's own planner; see ``vllm_groups_rig``. Each test
serves a prompt, pushes it out of the GPU tier with unrelated prompts and
serves it again: the returning request must load every group's blocks from
kvoffload's CPU tier, byte for byte what each group's layers held.
"""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.integrations.vllm_groups_rig import (  # noqa: E402
    KVOFFLOAD_SPEC,
    STOCK,
    VLLM_CPU_SPEC,
    GroupsRig,
    full_spec,
    layer_specs,
    sliding_spec,
)
from tests.integrations.vllm_rig import CONNECTOR  # noqa: E402

PROMPT = list(range(1, 129))  # 8 full blocks of 16 tokens


def serve_evict_return(rig: GroupsRig, n_flood: int = 3) -> None:
    rig.add(PROMPT, "first")
    rig.run()
    for i in range(n_flood):
        rig.add([2000 + 200 * i + j for j in range(len(PROMPT))], f"flood{i}")
        rig.run()
    rig.add([*PROMPT, 5, 6], "again")
    rig.run()


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
    reference = GroupsRig.build(
        tmp_path / "vllm",
        specs,
        {"cpu_bytes_to_use": 4 << 20, **VLLM_CPU_SPEC},
        STOCK,
        instant=True,
    )
    serve_evict_return(reference)
    assert rig.first_computed["again"] == reference.first_computed["again"] > 0
    assert sorted(rig.stored_keys) == sorted(reference.stored_keys)
    assert sorted(rig.loaded_keys) == sorted(reference.loaded_keys)
    assert {int.from_bytes(k[-4:], "big") for k in rig.loaded_keys} == {0, 1}
    assert not rig.mismatches
    assert rig.blocks_verified == len(rig.loaded_keys) and rig.bytes_verified > 0
    rig.shutdown()
    reference.shutdown()
