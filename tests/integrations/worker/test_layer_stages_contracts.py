"""``worker/layer_loads.LayerStages``: the staging contracts its docstring states (no vLLM).

- A wait before layer ``k`` waits for stages ``0..k`` of every staged load of the step,
  each (load, stage) once; a later layer of an earlier stage waits for nothing more.
- ``end_forward`` waits for every staged load whole and forgets them: nothing crosses a
  step, and the next step's waits start again from stage 0.
- Staging arms only after one forward pass called the hook for every layer; hooks split
  over two passes do not arm it.
"""

from __future__ import annotations

from kvoffload.integrations.vllm.worker.layer_loads import LayerStages

PLANES = [(1000, 64, 64), (5000, 64, 64)]
#: Layers "a" and "c" share stage 0, "b" is stage 1, "d" stage 2 (registration order).
LAYERS = {"a": (1032, 64, 32), "b": (1000, 64, 32), "c": (1032, 64, 32), "d": (5000, 64, 64)}


def _stages() -> LayerStages:
    stages = LayerStages.match(LAYERS, PLANES)
    assert stages is not None
    return stages


class _Waits:
    def __init__(self) -> None:
        self.stages: list[tuple[int, int]] = []
        self.whole: list[list[int]] = []

    def stage(self, job_id: int, stage: int) -> None:
        self.stages.append((job_id, stage))

    def jobs(self, job_ids: list[int]) -> None:
        self.whole.append(list(job_ids))


def test_a_layer_waits_for_its_stage_and_every_earlier_one_of_every_load_once() -> None:
    s, w = _stages(), _Waits()
    s.add(7)
    s.add(9)
    assert s.is_staged(7) and s.is_staged(9) and not s.is_staged(8)
    s.before_layer("b", w.stage)  # stage 1: stages 0 and 1 of both loads
    assert w.stages == [(7, 0), (9, 0), (7, 1), (9, 1)]
    s.before_layer("c", w.stage)  # stage 0: already waited for
    s.before_layer("a", w.stage)
    s.before_layer("unknown", w.stage)
    assert len(w.stages) == 4
    s.before_layer("d", w.stage)
    assert w.stages[4:] == [(7, 2), (9, 2)]


def test_the_forward_pass_ends_with_every_staged_load_whole_and_nothing_left() -> None:
    s, w = _stages(), _Waits()
    s.add(3)
    s.before_layer("a", w.stage)
    s.end_forward(w.jobs)
    assert w.whole == [[3]]
    assert not s.is_staged(3)
    s.before_layer("d", w.stage)  # the next step has no staged load: no wait at all
    assert w.stages == [(3, 0)]
    s.end_forward(w.jobs)
    assert w.whole == [[3]]  # nothing waited for when nothing was staged
    s.add(4)
    s.before_layer("b", w.stage)  # a new step's waits start again from stage 0
    assert w.stages[1:] == [(4, 0), (4, 1)]


def test_staging_arms_only_after_one_pass_called_the_hook_for_every_layer() -> None:
    s, w = _stages(), _Waits()
    for name in ("a", "b"):
        s.before_layer(name, w.stage)
    s.end_forward(w.jobs)
    for name in ("c", "d"):
        s.before_layer(name, w.stage)
    s.end_forward(w.jobs)
    assert not s.armed  # every layer was seen, but never in one pass
    for name in LAYERS:
        s.before_layer(name, w.stage)
    assert not s.armed  # armed when the pass ends
    s.end_forward(w.jobs)
    assert s.armed
    assert w.stages == [] and w.whole == []  # no load was staged: nothing waited for
