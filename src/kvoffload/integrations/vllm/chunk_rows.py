"""GPU <-> shared-region copies when an offloaded block spans several GPU blocks.

vLLM's shared offload region stores an offloaded block ("chunk") of ``f`` GPU
blocks in one row, per rank: ``[plane 0: f pages][plane 1: f pages]...``.
Sub-block ``j`` of every chunk is therefore a strided set of rows of its own
(one page per plane at offset ``j * page`` inside each plane's area), and
kvoffload's copy engine, which pairs one row per block per plane, copies it
as a host pool of one-block slots. ``ChunkSplitHandler`` runs a job over
``f`` such pools: it splits the job's sub-blocks by ``j`` (chunk ``c``,
sub-block ``j`` goes to pool ``j``'s slot ``c``), submits one job per pool
under the same job id, and reports the job once every part has finished
(failed if any part failed). A load may skip the first chunk's leading
sub-blocks (the GPU already holds them), as vLLM's loads do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvoffload.offload import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.transfer.handler import TransferHandler, describe_error
from kvoffload.transfer.spec import TransferResult, TransferSpec


@dataclass
class _Parts:
    left: set[int]
    src: str
    dst: str
    success: bool = True
    error: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0
    done: list[int] = field(default_factory=list)


class ChunkSplitHandler(TransferHandler):
    """One GPU <-> CPU handler per sub-block position of a chunk (``handlers[j]``)."""

    def __init__(self, handlers: Sequence[TransferHandler]) -> None:
        if not handlers:
            raise ValueError("ChunkSplitHandler needs at least one handler")
        self.handlers = list(handlers)
        self.factor = len(self.handlers)
        self._parts: dict[int, _Parts] = {}
        self._rejected: list[TransferResult] = []

    def split(self, spec: TransferSpec) -> dict[int, TransferSpec]:
        """The job's parts by sub-block position; ``ValueError`` for a job that cannot run."""
        f = self.factor
        if spec.media == (GPU_MEDIUM, CPU_MEDIUM):
            gpu, chunks, skip = spec.src.block_ids, spec.dst.block_ids, 0  # type: ignore[attr-defined]
            if gpu.size != chunks.size * f:
                raise ValueError(
                    f"store of {gpu.size} GPU blocks into {chunks.size} chunks of {f} blocks"
                )
        elif spec.media == (CPU_MEDIUM, GPU_MEDIUM):
            chunks, gpu = spec.src.block_ids, spec.dst.block_ids  # type: ignore[attr-defined]
            skip = chunks.size * f - gpu.size
            if not (0 <= skip < f or chunks.size == gpu.size == 0):
                raise ValueError(
                    f"load of {chunks.size} chunks of {f} blocks into {gpu.size} GPU blocks"
                )
        else:
            raise ValueError(f"cannot transfer {spec.media[0]} -> {spec.media[1]}")
        positions = np.arange(skip, chunks.size * f, dtype=np.int64)
        parts: dict[int, TransferSpec] = {}
        for j in range(f):
            mine = positions[positions % f == j]
            if mine.size == 0:
                continue
            gpu_ids = GPULoadStoreSpec(gpu[mine - skip])
            slots = CPULoadStoreSpec(chunks[mine // f])
            is_store = spec.media[0] == GPU_MEDIUM
            parts[j] = TransferSpec(gpu_ids, slots) if is_store else TransferSpec(slots, gpu_ids)
        if not parts:
            parts[0] = spec  # an empty job: let one handler report it
        return parts

    def submit(self, job_id: int, spec: TransferSpec) -> None:
        if job_id in self._parts:
            raise ValueError(f"job id {job_id} is already in use")
        src, dst = spec.media
        try:
            parts = self.split(spec)
        except (ValueError, TypeError, AttributeError) as exc:
            self._rejected.append(TransferResult(job_id, False, describe_error(exc), 0, src, dst))
            return
        self._parts[job_id] = _Parts(set(parts), src, dst)
        for j, part in parts.items():
            self.handlers[j].submit(job_id, part)

    def get_finished(self) -> list[TransferResult]:
        out, self._rejected = self._rejected, []
        for j, handler in enumerate(self.handlers):
            for r in handler.get_finished():
                parts = self._parts.get(r.job_id)
                if parts is None or j not in parts.left:
                    continue
                parts.left.discard(j)
                parts.num_bytes += r.num_bytes
                parts.seconds = max(parts.seconds, r.seconds)
                if not r.success:
                    parts.success = False
                    parts.error = parts.error or r.error
                if not parts.left:
                    del self._parts[r.job_id]
                    out.append(
                        TransferResult(
                            r.job_id,
                            parts.success,
                            parts.error,
                            parts.num_bytes if parts.success else 0,
                            parts.src,
                            parts.dst,
                            parts.seconds,
                        )
                    )
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        ids = list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        for handler in self.handlers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handler.wait(ids, left):
                return False
        return True

    def close(self) -> None:
        for handler in self.handlers:
            handler.close()
