"""vLLM's worker-side ``OffloadingWorker`` over kvoffload's transfer layer (0.32 and 0.33).

vLLM hands over its KV cache as ``CanonicalKVCaches``: int8 byte planes
``(num_blocks, page_bytes)`` whose row ``b`` is block ``b``. kvoffload copies
block rows between plane sets of one ``KVLayout``, so the planes are seen as
a ``kv_split`` layout of ``uint8`` "layers" (one per plane, each row split in
two halves standing in for K and V): every byte of every row is copied, bit
for bit, whatever the model's dtype. The CPU tier's ``HostPool`` uses the same
layout. On a GPU the copies run on CUDA streams into page-locked memory; on a
CPU-only machine (CI) the same worker runs the same jobs with a thread pool.

Where the CPU tier's bytes live: with the CPU tier alone, in a private host
pool per worker (job specs are ``KVOffloadJobSpec``s from ``KVOffloadManager``).
With lower tiers, in this rank's shard of vLLM's shared offload region, seen
as a host pool whose slot ``c`` is row ``c`` of the region (job specs are
vLLM's ``CPULoadStoreSpec`` chunk ids from vLLM's tiering manager; an
offloaded block of ``f`` GPU blocks is ``f`` such pools, see ``chunk_rows``).
The worker never touches disk or Redis: the scheduler process moves those
bytes between the region and the stores.

Any number of KV cache groups (hybrid models). vLLM's job specs list each
group's GPU blocks and CPU chunks in turn; ``chunk_rows.group_rows`` pairs
every GPU block with its CPU sub-block, group by group (a group's first block
may sit inside its first chunk), and the job copies those pairs. With one
slot class (``group_slots``) every plane row of a block is copied: vLLM's
groups alias one block-id space, so a plane that a group has no layer in is
unused by that group's blocks, and copying it moves bytes nobody reads but
never overwrites anybody's KV. With several classes (``group_pools``) each
group copies only its own layers' planes into its class's pool
(``group_jobs.GroupSplitHandler``), and its CPU chunk ids are slots of that
pool.

Failures. vLLM 0.33's offloading worker asserts ``success`` on every transfer
result, so a failed job would stop the engine. When the connector offers
recovery (``KVOffloadConnector`` does: ``recover_failed_loads``), a failed
load is reported successful to vLLM, its GPU block ids are handed to vLLM's
load-failure recovery (``get_block_ids_with_load_errors``: the scheduler
recomputes those blocks with ``kv_load_failure_policy="recompute"``, or fails
the request with the default ``"fail"``) and, for ``KVOffloadManager``'s jobs,
the job's tag goes back to the scheduler side, which drops what the job
touched. A failed store is reported successful too: its keys are dropped and
never offered. Without recovery (vLLM's stock connector) a failed job is reported
failed, and vLLM stops on its assertion rather than serve a block whose KV
was never written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvoffload.integrations.vllm.groups.group_slots import GroupSlotPlan
from kvoffload.integrations.vllm.scheduler.manager import KVOffloadJobSpec
from kvoffload.integrations.vllm.worker.chunk_rows import (
    ChunkSplitHandler,
    SubBlockSpec,
    group_rows,
)
from kvoffload.integrations.vllm.worker.group_jobs import GroupSplitHandler, RoutedSubBlockSpec
from kvoffload.integrations.vllm.worker.layer_loads import Extent, LayerStages, spare_core
from kvoffload.offload import CPULoadStoreSpec as KVCPUSpec
from kvoffload.offload import GPULoadStoreSpec as KVGPUSpec
from kvoffload.offload.base import BlockIDsLoadStoreSpec as KVBlockIDsSpec
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.transfer import HostPool, KVGeometry, KVLayout
from kvoffload.transfer.handler import TransferHandler, can_stage
from kvoffload.transfer.worker import OffloadingWorker as KVWorker
from kvoffload.transfer.worker import make_cpu_gpu_handler

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload")

#: The job tag of a job that no kvoffload manager prepared (vLLM's tiering manager did).
NO_OP = -1


def plane_layout(kv_caches: CanonicalKVCaches) -> tuple[KVLayout, list[torch.Tensor], int]:
    """A ``kv_split`` uint8 layout for vLLM's block planes, the planes viewed in it, num_blocks.

    All planes must have the same row size (a model whose layers share one
    page size: every dense or GQA transformer); anything else is refused.
    """
    tensors = [t.tensor for t in kv_caches.tensors]
    if not tensors:
        raise ValueError("vLLM registered no KV cache tensors to offload")
    rows = {int(t.shape[1]) for t in tensors}
    blocks = {int(t.shape[0]) for t in tensors}
    if len(rows) != 1 or len(blocks) != 1:
        raise ValueError(
            f"kvoffload needs KV planes of one page size, got pages {sorted(rows)} "
            f"and block counts {sorted(blocks)}"
        )
    row, num_blocks = rows.pop(), blocks.pop()
    if row % 2:
        raise ValueError(f"KV page of {row} bytes is not even")
    geometry = KVGeometry(
        num_layers=len(tensors),
        num_kv_heads=1,
        head_size=row // 2,
        block_size=1,
        dtype=torch.uint8,
    )
    layout = KVLayout(geometry, "kv_split")
    views = [t.view(torch.uint8).view(num_blocks, 2, 1, 1, row // 2) for t in tensors]
    layout.num_blocks_of(views)
    return layout, views, num_blocks


def class_pools(
    plan: GroupSlotPlan,
    kv_caches: CanonicalKVCaches,
    layout: KVLayout,
    views: list[torch.Tensor],
) -> tuple[list[tuple[list[torch.Tensor], KVLayout, HostPool]], list[int]]:
    """One host pool per slot class, and per group (position) its planes, pool and route.

    A group copies the planes its layers use (vLLM's ``group_data_refs``), in
    ref order, into the first planes of its class's pool (a windowed group
    narrower than its class leaves the rest of its slots unused, as vLLM's
    padded slots do). Where a group's planes do not fit the bytes the plan
    gave its class (a layout the plan cannot see), every group of the class
    copies every plane and the class's pool is as wide as the whole block:
    the slot counts stay the plan's, so slot ids agree with the scheduler's,
    and the pool takes more memory (logged).
    """
    row = layout.plane_row_bytes
    out: list[tuple[list[torch.Tensor], KVLayout, HostPool]] = []
    routes = [0] * len(plan.class_of)
    everything = list(range(len(views)))
    for cls in plan.classes:
        planes: dict[int, list[int]] = {}
        for g in cls.groups:
            refs = kv_caches.group_data_refs[g] if g < len(kv_caches.group_data_refs) else []
            planes[g] = list(dict.fromkeys(r.tensor_idx for r in refs))
        width = cls.bytes_per_block // row if cls.bytes_per_block % row == 0 else 0
        if any(not t or len(t) > width for t in planes.values()):
            logger.warning(
                "kvoffload: KV cache groups %s do not lay out as planned (%d bytes per block, "
                "planes of %d bytes); their slots hold whole blocks (%d bytes)",
                list(cls.groups),
                cls.bytes_per_block,
                row,
                row * len(views),
            )
            planes = {g: everything for g in cls.groups}
            width = len(views)
        pool = HostPool(_planes_layout(width, row), cls.num_slots, plan.blocks_per_chunk)
        for g, tensors in planes.items():
            group_layout = _planes_layout(len(tensors), row)
            group_pool = pool
            if len(tensors) < width:
                group_pool = HostPool.over_tensors(
                    group_layout, pool.tensors[: len(tensors)], pool.block_size_factor, pool.pinned
                )
            routes[g] = len(out)
            out.append(([views[t] for t in tensors], group_layout, group_pool))
    return out, routes


def _planes_layout(num_planes: int, row: int) -> KVLayout:
    """``num_planes`` uint8 planes of ``row``-byte rows, as ``plane_layout`` sees vLLM's."""
    return KVLayout(KVGeometry(num_planes, 1, row // 2, 1, torch.uint8), "kv_split")


def _flat(pool: HostPool) -> HostPool:
    """The same memory as one-block slots: jobs name CPU sub-blocks (chunk * f + j)."""
    if pool.block_size_factor == 1:
        return pool
    return HostPool.over_tensors(pool.layout, pool.tensors, 1, pinned=pool.pinned)


@dataclass
class _Job:
    op_id: int
    gpu_block_ids: list[int]
    is_load: bool


class KVOffloadWorker(OffloadingWorker):
    """Runs vLLM's transfer jobs on a kvoffload ``OffloadingWorker``.

    ``recover_failed_loads``: see the module docstring.
    ``sub_block_pools``: with offloaded blocks of ``f > 1`` GPU blocks in
    vLLM's shared rows, the ``f`` one-block pools (``host_pool`` is the first).
    ``group_pools`` / ``group_routes``: per slot class (or plane set), the GPU
    planes, their layout and the class's host pool; group ``g`` (position in
    vLLM's job specs) is copied by ``group_pools[group_routes[g]]``.
    ``stage_loads``: copy synchronous loads layer by layer (``layer_loads``)
    always (True), never (False), or where the forward pass leaves a core to
    the copy (None, the default: ``layer_loads.spare_core``).
    """

    stage_loads: bool | None = None

    def __init__(
        self,
        layout: KVLayout,
        gpu_tensors: list[torch.Tensor],
        host_pool: HostPool,
        recover_failed_loads: bool = False,
        num_threads: int = 2,
        on_shutdown: Callable[[], None] | None = None,
        sub_block_pools: Sequence[HostPool] | None = None,
        group_pools: Sequence[tuple[list[torch.Tensor], KVLayout, HostPool]] | None = None,
        group_routes: Sequence[int] | None = None,
    ) -> None:
        self.layout = layout
        self.gpu_tensors = gpu_tensors
        self.host_pool = host_pool
        self.recover_failed_loads = recover_failed_loads
        self.on_shutdown = on_shutdown
        self.worker = KVWorker()
        handler: TransferHandler
        self._routes: np.ndarray | None = None
        self.group_pools = list(group_pools or [])
        if group_pools is not None and group_routes is not None:
            self.blocks_per_chunk = host_pool.block_size_factor
            handler = GroupSplitHandler(
                [
                    make_cpu_gpu_handler(views, lay, _flat(pool), num_threads)
                    for views, lay, pool in group_pools
                ]
            )
            self._routes = np.asarray(group_routes, dtype=np.int64)
        elif sub_block_pools is not None and len(sub_block_pools) > 1:
            # Offloaded blocks of several GPU blocks in vLLM's shared rows: one pool
            # per sub-block position (see chunk_rows).
            self.blocks_per_chunk = len(sub_block_pools)
            handler = ChunkSplitHandler(
                [make_cpu_gpu_handler(gpu_tensors, layout, p, num_threads) for p in sub_block_pools]
            )
        else:
            # Jobs name CPU sub-blocks (chunk * f + j): copy through a one-block-slot
            # view of the same memory.
            self.blocks_per_chunk = host_pool.block_size_factor
            handler = make_cpu_gpu_handler(gpu_tensors, layout, _flat(host_pool), num_threads)
        self.worker.register_handler(GPU_MEDIUM, CPU_MEDIUM, handler)
        self.worker.register_handler(CPU_MEDIUM, GPU_MEDIUM, handler)
        self._jobs: dict[int, _Job] = {}
        self._load_error_blocks: set[int] = set()
        self._failed_ops: set[int] = set()
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.failed_jobs = 0
        self.failed_job_ids: set[int] = set()
        self._expedite: set[int] = set()
        self.layer_stages: LayerStages | None = None

    @staticmethod
    def _inner(spec: LoadStoreSpec) -> tuple[KVBlockIDsSpec, int]:
        if isinstance(spec, KVOffloadJobSpec) and isinstance(spec.inner, KVBlockIDsSpec):
            return spec.inner, spec.op_id
        if isinstance(spec, BlockIDsLoadStoreSpec) and type(spec).__name__ == "CPULoadStoreSpec":
            # vLLM's tiering manager (lower tiers configured): its CPU chunk ids are
            # rows of the shared region, which are this worker's host pool slots.
            return KVCPUSpec(spec.block_ids), NO_OP
        raise TypeError(f"expected a kvoffload or CPU job spec, got {type(spec).__name__}")

    def _pair(self, gpu: GPULoadStoreSpec, cpu: KVBlockIDsSpec) -> tuple[KVGPUSpec, SubBlockSpec]:
        """The job as (GPU blocks, CPU sub-blocks) of equal length; a job that does not
        fit its groups gets specs the handler refuses (a failed result, nothing written)."""
        try:
            rows = group_rows(
                gpu.block_ids,
                gpu.group_sizes,
                gpu.block_indices,
                cpu.block_ids,
                self.blocks_per_chunk,
            )
        except ValueError as exc:
            logger.warning("kvoffload: refusing a transfer job: %s", exc)
            return KVGPUSpec([0]), SubBlockSpec([])
        if self._routes is None:
            return KVGPUSpec(rows.gpu), SubBlockSpec(rows.sub_blocks)
        routes = np.empty(rows.gpu.size, dtype=np.int64)
        for k, g in enumerate(rows.groups):
            if g >= self._routes.size:
                logger.warning("kvoffload: refusing a transfer job: no KV cache group %d", g)
                return KVGPUSpec([0]), SubBlockSpec([])
            routes[rows.starts[k] : rows.starts[k + 1]] = self._routes[g]
        return KVGPUSpec(rows.gpu), RoutedSubBlockSpec(rows.sub_blocks, routes)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        inner, op_id = self._inner(dst_spec)
        gpu, cpu = self._pair(src_spec, inner)
        self._jobs[job_id] = _Job(op_id, [], False)
        self.worker.submit_store(job_id, (gpu, cpu))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # vLLM 0.32 has no flag: its synchronous jobs are named beforehand (expedite).
        expedited = expedited or job_id in self._expedite
        self._expedite.discard(job_id)
        inner, op_id = self._inner(src_spec)
        gpu, cpu = self._pair(dst_spec, inner)
        self._jobs[job_id] = _Job(op_id, [int(b) for b in dst_spec.block_ids], True)
        layers = self.layer_stages
        if expedited and layers is not None and layers.armed and self.stages_now():
            layers.add(job_id)
            self.worker.submit_load(job_id, (cpu, gpu), True, layers.stages)
        else:
            self.worker.submit_load(job_id, (cpu, gpu), expedited)
        return True

    def stages_now(self) -> bool:
        """Whether an armed synchronous load submitted from this thread is staged."""
        return spare_core() if self.stage_loads is None else self.stage_loads

    def expedite(self, job_ids: set[int]) -> None:
        """Submit these loads, when they come, as expedited (waited for in the same step)."""
        self._expedite = set(job_ids)

    def stage_by_layer(self, layers: dict[str, Extent] | None) -> bool:
        """Copy synchronous loads layer by layer (``layer_loads``) where every layer's
        KV (vLLM's ``register_kv_caches``) lies inside this worker's block rows."""
        handler = self.worker.handlers.get((CPU_MEDIUM, GPU_MEDIUM))
        if layers is None or not can_stage(handler):
            return False
        planes = [
            (p.data_ptr(), p.stride(0), p.shape[1])
            for p in self.layout.block_planes(self.gpu_tensors)
        ]
        self.layer_stages = LayerStages.match(layers, planes)
        return self.layer_stages is not None

    def before_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: its part of this step's staged loads is in."""
        if self.layer_stages is not None:
            self.layer_stages.before_layer(layer_name, self.worker.wait_stage)

    def end_forward(self) -> None:
        """After the step's forward pass: every staged load is in."""
        if self.layer_stages is not None:
            self.layer_stages.end_forward(self.worker.wait)

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for r in self.worker.get_finished():
            job = self._jobs.pop(r.job_id, None)
            success = r.success
            if not success:
                self.failed_jobs += 1
                self.failed_job_ids.add(r.job_id)
                kind = "load" if job is not None and job.is_load else "store"
                logger.warning("kvoffload: %s job %d failed: %s", kind, r.job_id, r.error)
                if job is not None and self.recover_failed_loads:
                    if job.op_id != NO_OP:
                        self._failed_ops.add(job.op_id)
                    if job.is_load:
                        self._load_error_blocks.update(job.gpu_block_ids)
                    success = True
            elif job is not None and job.is_load:
                self.bytes_loaded += r.num_bytes
            else:
                self.bytes_stored += r.num_bytes
            out.append(TransferResult(r.job_id, success, r.num_bytes, r.seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        layers = self.layer_stages
        if layers is not None:
            # Staged loads are waited for layer by layer during the forward pass.
            job_ids = {j for j in job_ids if not layers.is_staged(j)}
        self.worker.wait(job_ids)

    def in_flight_job_ids(self) -> set[int]:
        """Jobs submitted whose results ``get_finished`` has not returned yet."""
        return set(self._jobs)

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every job in flight has finished; False if ``timeout`` expired first."""
        return self.worker.wait(list(self._jobs), timeout)

    def take_load_error_blocks(self) -> set[int]:
        """GPU block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def take_failed_ops(self) -> set[int]:
        """Tags of the manager's jobs that failed since the last call."""
        out, self._failed_ops = self._failed_ops, set()
        return out

    def num_in_flight(self) -> int:
        return self.worker.num_in_flight()

    def shutdown(self) -> None:
        self.worker.close()
        if self.on_shutdown is not None:
            # The host pool may view memory the hook releases (the shared region):
            # drop this worker's views of it first.
            self.worker = KVWorker()
            self.host_pool = None  # type: ignore[assignment]
            self.on_shutdown()
            self.on_shutdown = None
