"""One vLLM transfer job over several KV cache groups whose slots live in different host pools.

With slot classes (``group_slots``) each group copies its own layers' planes
into its class's host pool, so a job naming several groups is several copies:
``GroupSplitHandler`` sends group ``g``'s (GPU block, CPU sub-block) pairs to
``handlers[route[g]]`` under the job's id and reports the job once every part
has finished (failed if any part failed), as ``ChunkSplitHandler`` does for
sub-block positions. A handler sees the sub-block ids of its class's pool;
a flat (one-block-slot) pool takes them as slot ids, a ``ChunkSplitHandler``
splits them further by position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.integrations.vllm.worker.chunk_rows import ChunkSplitHandler, SubBlockSpec
from kvoffload.offload import GPULoadStoreSpec
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.transfer.handler import TransferHandler
from kvoffload.transfer.spec import TransferSpec


class RoutedSubBlockSpec(SubBlockSpec):
    """CPU sub-blocks of a job with, for each, the handler (``routes[i]``) that copies it."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray, routes: np.ndarray) -> None:
        super().__init__(block_ids)
        self.routes = np.asarray(routes, dtype=np.int64)
        if self.routes.shape != self.block_ids.shape:
            raise ValueError(f"{self.routes.size} routes for {self.block_ids.size} sub-blocks")


class GroupSplitHandler(ChunkSplitHandler):
    """``handlers[k]`` copies the pairs routed to ``k`` (one per slot class and plane set)."""

    def __init__(self, handlers: Sequence[TransferHandler]) -> None:
        super().__init__(handlers)

    def split(self, spec: TransferSpec) -> dict[int, TransferSpec]:
        """The job's parts by route; ``ValueError`` for a job that cannot run."""
        is_store = spec.media == (GPU_MEDIUM, CPU_MEDIUM)
        if not is_store and spec.media != (CPU_MEDIUM, GPU_MEDIUM):
            raise ValueError(f"cannot transfer {spec.media[0]} -> {spec.media[1]}")
        gpu_spec, cpu = (spec.src, spec.dst) if is_store else (spec.dst, spec.src)
        if not isinstance(cpu, RoutedSubBlockSpec):
            raise TypeError(f"expected routed CPU sub-blocks, got {type(cpu).__name__}")
        gpu = gpu_spec.block_ids  # type: ignore[attr-defined]
        if gpu.size != cpu.block_ids.size:
            raise ValueError(f"{gpu.size} GPU blocks for {cpu.block_ids.size} CPU sub-blocks")
        bad = cpu.routes[(cpu.routes < 0) | (cpu.routes >= len(self.handlers))]
        if bad.size:
            raise ValueError(f"route {int(bad[0])} names no handler (of {len(self.handlers)})")
        parts: dict[int, TransferSpec] = {}
        for k in np.unique(cpu.routes).tolist():
            mine = cpu.routes == k
            g = GPULoadStoreSpec(gpu[mine])
            c = SubBlockSpec(cpu.block_ids[mine])
            parts[int(k)] = TransferSpec(g, c) if is_store else TransferSpec(c, g)
        if not parts:
            parts[0] = TransferSpec(spec.src, spec.dst)
        return parts
