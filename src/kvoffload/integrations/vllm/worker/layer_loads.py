"""Synchronous loads copied layer by layer, under the forward pass that reads them.

A synchronous load's request computes in the step that loads it. Waiting for
the whole load before the forward pass puts every byte of the copy on that
step's critical path, yet attention layer ``k`` reads only layer ``k``'s KV.
vLLM calls the connector's ``wait_for_layer_load(layer)`` before each
attention layer, so a load staged as one part per layer (in the order vLLM
registered the layers) copies on the transfer threads while the layers before
it compute: the forward pass waits only where it catches up with the copy.

Staging is armed only once the engine has shown, in a forward pass, that it
calls the hook for every layer that reads a staged plane: a model whose
attention skipped the hook would read KV not yet copied. Until then, and for
a load that cannot be staged, the load is waited for whole before the forward
pass, as before. A wait for layer ``k`` waits for stages ``0..k``, so an
order of layers unlike the registration's costs time, never correctness, and
every staged job is waited for whole when the forward pass ends
(``end_forward``): nothing crosses a step.

Staging pays only where the forward pass leaves a core to the copy
(``spare_core``): on a CPU engine whose torch threads fill every core, the
copy thread takes turns with the forward pass's OpenMP team, and each of the
team's parallel regions waits at its barrier for the thread it lost (the
oversubscription that cost ``bench transfer``'s jobs a third beside a
spinning team: ``bench/transfer/child.SETTLE_S``). ``kvoffload bench vllm
--hits`` runs its engines on one torch thread each (a core nominally spare)
and gives staged and whole loads side by side.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvoffload.transfer.copy_plan import Span


def spare_core() -> bool:
    """Whether the calling thread's torch threads (the forward pass's team, asked on the
    engine's thread) are fewer than the CPUs this process may run on."""
    import os

    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


#: Where a layer's KV lies: (address of block 0, bytes between blocks, bytes per block).
Extent = tuple[int, int, int]


class LayerStages:
    """Which bytes of the block rows each attention layer reads, and this step's staged loads.

    ``stages[k]``: the spans first read by the ``k``-th distinct layer (layers
    aliasing one span share its stage); ``stage_of_layer``: every layer's stage.
    """

    def __init__(self, stages: list[list[Span]], stage_of_layer: dict[str, int]) -> None:
        self.stages = stages
        self.stage_of_layer = stage_of_layer
        self.armed = False
        self._seen: set[str] = set()
        self._jobs: list[int] = []  # this step's staged loads
        self._done = 0  # stages of this step's loads known to be done

    @classmethod
    def match(cls, layers: Mapping[str, Extent], planes: Sequence[Extent]) -> LayerStages | None:
        """Stages from each layer's extent (in vLLM's ``register_kv_caches`` order) and each
        plane's (its rows); None unless every layer lies inside one plane's rows, with the
        same block stride, and layers that overlap coincide."""
        if not layers:
            return None
        span_stage: dict[Span, int] = {}
        stages: list[list[Span]] = []
        stage_of_layer: dict[str, int] = {}
        for name, (ptr, stride, size) in layers.items():
            span = _span_in(ptr, stride, size, planes)
            if span is None:
                return None
            if span not in span_stage:
                span_stage[span] = len(stages)
                stages.append([span])
            stage_of_layer[name] = span_stage[span]
        spans = sorted(span_stage)
        for (p0, _, end), (p1, start, _) in itertools.pairwise(spans):
            if p0 == p1 and start < end:
                return None  # partly overlapping layers: no order of stages is safe
        return cls(stages, stage_of_layer)

    def add(self, job_id: int) -> None:
        """``job_id`` was submitted staged in this step."""
        self._jobs.append(job_id)

    def is_staged(self, job_id: int) -> bool:
        return job_id in self._jobs

    def before_layer(self, layer_name: str, wait_stage: Callable[[int, int], None]) -> None:
        """Before ``layer_name``'s attention: its stage (and those before) of every load."""
        self._seen.add(layer_name)
        stage = self.stage_of_layer.get(layer_name)
        if stage is None or not self._jobs or stage < self._done:
            return
        for k in range(self._done, stage + 1):
            for job_id in self._jobs:
                wait_stage(job_id, k)
        self._done = stage + 1

    def end_forward(self, wait_jobs: Callable[[list[int]], object]) -> None:
        """After the step's forward pass: every staged load whole; arm once every layer
        called the hook in one forward pass."""
        if self._jobs:
            wait_jobs(self._jobs)
        if not self.armed and self._seen >= self.stage_of_layer.keys():
            self.armed = True
        self._jobs, self._done = [], 0
        self._seen = set()


def layer_extents(kv_caches: Mapping[str, Any]) -> dict[str, Extent] | None:
    """Each layer's extent from vLLM's per-layer KV views; None when a layer's view is not
    blocks first with each block's bytes contiguous (staging then stays off)."""
    out: dict[str, Extent] = {}
    for name, t in kv_caches.items():
        if t.dim() < 2 or not t[0].is_contiguous():
            return None
        elem = t.element_size()
        out[name] = (t.data_ptr(), t.stride(0) * elem, t[0].numel() * elem)
    return out


def _span_in(ptr: int, stride: int, size: int, planes: Sequence[Extent]) -> Span | None:
    for p, (base, row_stride, row_bytes) in enumerate(planes):
        if base <= ptr and ptr + size <= base + row_bytes and stride == row_stride:
            return (p, ptr - base, ptr - base + size)
    return None
