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

Several KV cache groups. vLLM's job specs concatenate the groups: the GPU
side lists each group's blocks in turn (``group_sizes``), the CPU side each
group's chunks in turn, and group ``g``'s first GPU block sits at position
``block_indices[g] % f`` of its first chunk (vLLM's worker reads them so).
``group_rows`` resolves that into one CPU sub-block per GPU block
(``SubBlockSpec``: sub-block ``j`` of chunk ``c`` is ``c * f + j``), group by
group; a handler given sub-block ids takes them as they are.
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


class SubBlockSpec(CPULoadStoreSpec):
    """CPU sub-blocks, one per GPU block of a job: sub-block j of chunk c is ``c * f + j``."""


@dataclass(frozen=True)
class GroupRows:
    """A multi-group job resolved to one CPU sub-block per GPU block.

    ``gpu[i]`` pairs with ``sub_blocks[i]``; group ``groups[k]``'s pairs are
    ``starts[k]:starts[k + 1]`` (groups without blocks in the job are left out).
    """

    gpu: np.ndarray
    sub_blocks: np.ndarray
    groups: tuple[int, ...]
    starts: tuple[int, ...]


def group_rows(
    gpu_block_ids: Sequence[int] | np.ndarray,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    chunk_ids: Sequence[int] | np.ndarray,
    factor: int,
) -> GroupRows:
    """Pair every GPU block of a vLLM job with its CPU sub-block, group by group.

    ``group_sizes=None`` is one group starting at chunk position 0 (a load may
    then skip the first chunk's leading sub-blocks, as with one group before).
    ``ValueError`` when the chunk count does not match the groups' blocks
    (each group needs ``ceil((block_indices[g] % f + group_sizes[g]) / f)``
    chunks): such a job cannot run and writes nothing.
    """
    gpu = np.asarray(gpu_block_ids, dtype=np.int64).reshape(-1)
    chunks = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)
    f = factor
    if group_sizes is None:
        skip = chunks.size * f - gpu.size
        if not (0 <= skip < f or chunks.size == gpu.size == 0):
            raise ValueError(f"{chunks.size} chunks of {f} blocks for {gpu.size} GPU blocks")
        sizes, firsts = [gpu.size], [skip]
    else:
        sizes = [int(n) for n in group_sizes]
        firsts = [int(i) % f for i in (block_indices or [0] * len(sizes))]
        if len(firsts) != len(sizes) or sum(sizes) != gpu.size:
            raise ValueError(
                f"group sizes {sizes} and block indices {list(block_indices or [])} do not "
                f"describe {gpu.size} GPU blocks"
            )
    subs = np.empty(gpu.size, dtype=np.int64)
    groups: list[int] = []
    starts: list[int] = []
    at = used = 0
    for g, (n, first) in enumerate(zip(sizes, firsts)):
        if n == 0:
            continue
        need = -(-(first + n) // f)
        if used + need > chunks.size:
            raise ValueError(
                f"group {g}: {n} GPU blocks from chunk position {first} need {need} chunks, "
                f"the job has {chunks.size - used} left"
            )
        pos = np.arange(first, first + n, dtype=np.int64)
        subs[at : at + n] = chunks[used + pos // f] * f + pos % f
        groups.append(g)
        starts.append(at)
        at += n
        used += need
    if used != chunks.size:
        raise ValueError(f"the job names {chunks.size} chunks, its GPU blocks fill {used}")
    starts.append(at)
    return GroupRows(gpu, subs, tuple(groups), tuple(starts))


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
        cpu = spec.dst if spec.media[0] == GPU_MEDIUM else spec.src
        if isinstance(cpu, SubBlockSpec):
            return self._split_sub_blocks(spec, cpu)
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

    def _split_sub_blocks(self, spec: TransferSpec, cpu: SubBlockSpec) -> dict[int, TransferSpec]:
        f = self.factor
        is_store = spec.media == (GPU_MEDIUM, CPU_MEDIUM)
        if not is_store and spec.media != (CPU_MEDIUM, GPU_MEDIUM):
            raise ValueError(f"cannot transfer {spec.media[0]} -> {spec.media[1]}")
        gpu = (spec.src if is_store else spec.dst).block_ids  # type: ignore[attr-defined]
        subs = cpu.block_ids
        if gpu.size != subs.size:
            raise ValueError(f"{gpu.size} GPU blocks for {subs.size} CPU sub-blocks")
        parts: dict[int, TransferSpec] = {}
        for j in range(f):
            mine = subs % f == j
            if not mine.any():
                continue
            gpu_ids = GPULoadStoreSpec(gpu[mine])
            slots = CPULoadStoreSpec(subs[mine] // f)
            parts[j] = TransferSpec(gpu_ids, slots) if is_store else TransferSpec(slots, gpu_ids)
        if not parts:
            parts[0] = TransferSpec(spec.src, spec.dst)
        return parts

    def submit(self, job_id: int, spec: TransferSpec, expedited: bool = False) -> None:
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
            self.handlers[j].submit(job_id, part, expedited)

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
