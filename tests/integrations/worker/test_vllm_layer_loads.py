"""Synchronous loads copied layer by layer under the forward pass (``layer_loads``).

vLLM's real scheduler and worker-side connector (the rig); the rig's fake
forward pass calls ``wait_for_layer_load`` before each layer's attention and
checks, at that moment, that the layer's KV of the step's synchronous loads
is in place. No timing: the transfer threads are held busy where a test needs
the copy to be late, so the order of events is fixed.
"""

from tests.vllm_required import need_vllm

need_vllm()

import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from kvoffload.integrations.vllm.worker import worker as worker_module  # noqa: E402
from kvoffload.integrations.vllm.worker.layer_loads import LayerStages  # noqa: E402
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM  # noqa: E402
from tests.integrations.scheduler.test_vllm_sync_loads import (  # noqa: E402
    _evicted,
    _rig,
    _spy_expedited,
    _steps_until_scheduled,
)
from tests.integrations.test_vllm_engine import PROMPT, PROMPT_BLOCKS, assert_no_leaks  # noqa: E402
from tests.integrations.vllm_rig import VLLMRig  # noqa: E402


def _layered_rig(tmp_path: Path, path: str, stage: bool | None = True) -> VLLMRig:
    rig = _rig(tmp_path, path, budget=None)
    rig.forward_layers = True
    rig.kv_worker.stage_loads = stage  # staged whatever the machine's cores (spare_core)
    return rig


def _hit_again(rig: VLLMRig) -> None:
    _evicted(rig, PROMPT)  # its forward passes call every layer's hook: staging arms
    stages = rig.kv_worker.layer_stages
    assert stages is not None and stages.armed
    # Nothing runs now: wipe the device KV so that only the load can put the prefix back.
    for plane in rig._planes():
        plane.zero_()
    rig.add([*PROMPT, 5, 6], req_id="again")


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_a_synchronous_hit_is_loaded_layer_by_layer_and_each_layer_in_time(
    tmp_path: Path, path: str
) -> None:
    rig = _layered_rig(tmp_path, path)
    _hit_again(rig)
    expedited = _spy_expedited(rig)
    assert _steps_until_scheduled(rig, "again") == 1
    assert expedited == [True] and len(rig.sync_loads) == 1
    rig.run()
    assert rig.first_computed["again"] == len(PROMPT)
    assert rig.early_reads == [] and rig.mismatches == []
    assert rig.blocks_verified == PROMPT_BLOCKS
    assert_no_leaks(rig)
    rig.shutdown()


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_each_layer_waits_for_its_own_kv_only(tmp_path: Path, path: str) -> None:
    """With the transfer threads held, a layer's KV is copied when its attention comes
    (by the waiting thread) and a later layer's not before: the load is staged."""
    rig = _layered_rig(tmp_path, path)
    _hit_again(rig)
    handler = rig.kv_worker.worker.handlers[(CPU_MEDIUM, GPU_MEDIUM)]
    gate = threading.Event()
    blockers = [handler._pool.submit(gate.wait, 60) for _ in range(handler.num_threads)]
    spans = rig.layer_spans()
    later_loaded: list[str] = []
    blocks: list[tuple[int, bytes]] = []

    def look(name: str) -> None:
        if not blocks:
            load = rig._pending[rig.sync_loads[-1]]
            blocks.extend(zip(load.gpu_blocks, load.hashes))
        names = list(spans)
        later = [n for n in names[names.index(name) + 1 :] if spans[n] != spans[name]]
        later_loaded.extend(n for n in later if rig.layer_in_place(spans[n], *blocks[0]))

    rig.on_layer = look
    try:
        assert _steps_until_scheduled(rig, "again") == 1
    finally:
        gate.set()
        for b in blockers:
            b.result(timeout=60)
    assert len(set(spans.values())) > 1 and blocks
    assert later_loaded == []  # no layer's KV arrived before its turn
    assert rig.early_reads == []
    rig.on_layer = None
    rig.run()
    assert rig.mismatches == [] and rig.blocks_verified == PROMPT_BLOCKS
    assert_no_leaks(rig)
    rig.shutdown()


def test_without_the_layer_hooks_staging_never_arms(tmp_path: Path) -> None:
    rig = _rig(tmp_path, "native", budget=None)  # its forward calls no wait_for_layer_load
    _evicted(rig, PROMPT)
    rig.add([*PROMPT, 5, 6], req_id="again")
    assert _steps_until_scheduled(rig, "again") == 1
    stages = rig.kv_worker.layer_stages
    assert stages is not None and not stages.armed
    assert rig.late_sync_loads == []  # waited whole before the forward pass, as before
    rig.run()
    assert rig.mismatches == [] and rig.blocks_verified == PROMPT_BLOCKS
    rig.shutdown()


def test_stages_follow_the_layers_and_refuse_unknown_memory() -> None:
    # Two planes of 64-byte rows; layers are 32-byte halves (one packed plane) or a plane.
    planes = [(1000, 64, 64), (5000, 64, 64)]
    layers = {"a": (1032, 64, 32), "b": (1000, 64, 32), "c": (1032, 64, 32), "d": (5000, 64, 64)}
    stages = LayerStages.match(layers, planes)
    assert stages is not None
    assert stages.stages == [[(0, 32, 64)], [(0, 0, 32)], [(1, 0, 64)]]
    assert stages.stage_of_layer == {"a": 0, "b": 1, "c": 0, "d": 2}
    assert LayerStages.match({"a": (9000, 64, 32)}, planes) is None  # outside every plane
    assert LayerStages.match({"a": (1000, 128, 32)}, planes) is None  # another block stride
    assert LayerStages.match({"a": (1040, 64, 32)}, planes) is None  # past the row's end
    overlap = {"a": (1000, 64, 32), "b": (1016, 64, 32)}
    assert LayerStages.match(overlap, planes) is None
    assert LayerStages.match({}, planes) is None


@pytest.mark.parametrize("spare", [False, True])
def test_without_a_spare_core_a_synchronous_hit_is_loaded_whole_before_the_forward_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare: bool
) -> None:
    """By default a load is staged only where the forward pass leaves a core to the copy:
    copied under a forward pass whose threads fill every core, it slowed the pass more
    than the copy took (``layer_loads``' docstring)."""
    monkeypatch.setattr(worker_module, "spare_core", lambda: spare)
    rig = _layered_rig(tmp_path, "native", stage=None)
    _hit_again(rig)
    inner = rig.kv_worker.worker
    submitted: dict[int, bool] = {}
    real = inner.submit_load

    def spy(job_id: int, spec: Any, expedited: bool = False, stages: Any = None) -> None:
        submitted[job_id] = stages is not None
        real(job_id, spec, expedited, stages)

    monkeypatch.setattr(inner, "submit_load", spy)
    assert _steps_until_scheduled(rig, "again") == 1
    assert submitted == {rig.sync_loads[-1]: spare}
    rig.run()
    assert rig.early_reads == [] and rig.mismatches == []
    assert rig.blocks_verified == PROMPT_BLOCKS
    assert_no_leaks(rig)
    rig.shutdown()
