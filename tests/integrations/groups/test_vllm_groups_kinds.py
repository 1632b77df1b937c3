"""Every kind of KV cache group vLLM builds, through kvoffload's CPU tier inside vLLM 0.33's
real scheduler: the same stores and loads, per group, as vLLM's own ``CPUOffloadingSpec``.

For each kind (sliding window, chunked local attention, MLA + sliding window,
Mamba in "align" mode, an EAGLE / MTP drafter group) vLLM's planner groups a
small model's layers; both engines serve the same requests (a prompt, three
unrelated prompts that push it out of the GPU tier, the prompt again, then a
prompt sharing only part of it). vLLM's CPU spec runs its scheduler side
alone (its worker needs CUDA), its jobs reported done at once: what is
compared is what the scheduler decides (the keys stored, the keys loaded, the
tokens each request found computed), and kvoffload's loads are checked byte
for byte against what each group's layers held.
"""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.integrations.vllm_groups_rig import (  # noqa: E402
    KINDS,
    GroupsRig,
    layer_specs,
    serve_evict_return,
    vllm_cpu_reference,
)
from tests.integrations.vllm_rig import CONNECTOR  # noqa: E402

PROMPT = list(range(1, 161))  # 10 full blocks of 16 tokens


def serve(rig: GroupsRig) -> None:
    serve_evict_return(rig, PROMPT, flood_base=3000)
    rig.add([*PROMPT[:100], *range(900, 960)], "part")
    rig.run()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stores_and_loads_per_group_match_vllms_cpu_spec(tmp_path: Path, kind: str) -> None:
    specs = layer_specs(KINDS[kind]())
    ours = GroupsRig.build(tmp_path / "kvoffload", specs, {"cpu_bytes": "8MiB"}, CONNECTOR)
    serve(ours)
    theirs = vllm_cpu_reference(tmp_path / "vllm", specs, 8 << 20)
    serve(theirs)
    assert len(ours.groups) >= 2
    assert sorted(ours.stored_keys) == sorted(theirs.stored_keys)
    assert sorted(ours.loaded_keys) == sorted(theirs.loaded_keys)
    assert ours.first_computed == theirs.first_computed
    assert not ours.mismatches
    if kind == "mamba_align":
        # A Mamba group's state is offloaded from the copy-on-write block vLLM hands
        # over once the model runner has copied it (``boundary_state_offloads``);
        # this rig runs no model, so neither engine stores Mamba state and, as a hit
        # needs every group, neither finds one: the decisions above are what is
        # compared (the full-attention group's stores included).
        assert {int.from_bytes(k[-4:], "big") for k in ours.stored_keys} == {0}
        return
    assert ours.first_computed["again"] > 0, "the returning prompt should hit the CPU tier"
    assert ours.blocks_verified > 0
    groups = {int.from_bytes(k[-4:], "big") for k in ours.loaded_keys}
    assert groups == set(range(len(ours.groups)))
    ours.shutdown()
    theirs.shutdown()
