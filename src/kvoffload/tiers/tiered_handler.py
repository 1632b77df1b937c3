"""Jobs with a ``TieredLoadStoreSpec``: lower-tier copies around the GPU <-> CPU copy.

The tiered manager hands the worker, for a load, ``TIERED -> GPU`` (promote
lower-tier blocks into CPU slots, then copy the CPU slots to the GPU) and,
for a store, ``GPU -> TIERED`` (write evicted CPU slots down, copy the GPU
blocks into CPU slots, then write them through). Each job runs its steps in
order on one pool thread, which is what makes slot reuse safe: a victim's
slot is read before the same job overwrites it.

A required step (a promotion) or the GPU <-> CPU copy failing fails the
job; a best-effort step (a write-down) failing is counted and the job goes
on. Failed write-downs are logged at WARNING once when a pair (CPU -> DISK,
say) starts failing and once, with the count, when it works again: a full
disk or a refusing server fails every write-down for as long as it lasts.

The GPU <-> CPU copy runs on a handler this one owns (its results are
not the worker's), so the copy path, CUDA streams included, is the CPU
tier's own.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.offload.base import LoadStoreSpec
from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM
from kvoffload.tiers.lower_tier import TIERED_MEDIUM, TierCopy, TieredLoadStoreSpec
from kvoffload.tiers.slot_io import BlocksMissing, SlotTierHandler
from kvoffload.transfer.handler import ThreadPoolTransferHandler, TransferHandler, Work
from kvoffload.transfer.spec import TransferResult, TransferSpec

logger = logging.getLogger(__name__)

GPU = GPU_MEDIUM
CPU = CPU_MEDIUM
# How long one wait on the GPU <-> CPU sub-job blocks before re-checking results.
_SUB_WAIT_S = 1.0


class JobRejected(RuntimeError):
    """The tiered manager marked the job as one that must fail (e.g. no room to promote)."""


@dataclass
class TieredHandlerStats:
    """Blocks moved per (src, dst) pair, and steps that failed."""

    blocks: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    best_effort_failures: int = 0
    required_failures: int = 0


class TieredTransferHandler(ThreadPoolTransferHandler):
    """Executes ``TIERED -> GPU`` and ``GPU -> TIERED`` jobs.

    ``cpu_gpu``: a GPU <-> CPU handler for the engine's KV tensors and the
    CPU tier's host pool, owned by this handler (``make_cpu_gpu_handler``
    builds one; do not share the worker's). ``lower``: the lower tiers'
    handlers (one per medium), whose synchronous copies the steps call:
    CPU <-> a tier, and a move from one tier into another (a write-down
    cascading from disk to remote).
    """

    def __init__(
        self,
        cpu_gpu: TransferHandler,
        lower: Sequence[SlotTierHandler] = (),
        num_threads: int = 4,
    ) -> None:
        super().__init__(num_threads, thread_name_prefix="kvoffload-tiered-job")
        self.cpu_gpu = cpu_gpu
        self.lower: dict[str, SlotTierHandler] = {h.tier_medium: h for h in lower}
        if len(self.lower) != len(lower):
            raise ValueError("lower-tier handlers must have distinct media")
        self.stats = TieredHandlerStats()
        self._sub_ids = itertools.count(1)
        self._sub_lock = threading.Lock()
        self._sub_results: dict[int, TransferResult] = {}
        self._stats_lock = threading.Lock()
        # Consecutive failed best-effort copies per (src, dst) pair.
        self._failing: Counter[tuple[str, str]] = Counter()

    # -- validation ---------------------------------------------------------------

    def _supports(self, src: str, dst: str) -> bool:
        if src == CPU:
            return dst in self.lower
        return src in self.lower and (dst == CPU or (dst in self.lower and dst != src))

    def prepare(self, job_id: int, spec: TransferSpec) -> Work:
        if spec.media == (TIERED_MEDIUM, GPU):
            tiered, gpu, is_load = spec.src, spec.dst, True
        elif spec.media == (GPU, TIERED_MEDIUM):
            tiered, gpu, is_load = spec.dst, spec.src, False
        else:
            raise ValueError(
                f"cannot transfer {spec.media[0]} -> {spec.media[1]} (tiered jobs only)"
            )
        assert isinstance(tiered, TieredLoadStoreSpec)
        if tiered.error:
            raise JobRejected(tiered.error)
        for step in (*tiered.before, *tiered.after):
            src, dst = step.src.medium(), step.dst.medium()
            if not self._supports(src, dst):
                raise ValueError(f"no lower-tier copy for {src} -> {dst} in this worker")
        return lambda: self._execute(tiered, gpu, is_load)

    # -- running ------------------------------------------------------------------

    def _execute(self, tiered: TieredLoadStoreSpec, gpu: LoadStoreSpec, is_load: bool) -> int:
        moved = 0
        for step in tiered.before:
            moved += self._step(step)
        sub = TransferSpec(tiered.cpu, gpu) if is_load else TransferSpec(gpu, tiered.cpu)
        moved += self._gpu_copy(sub)
        for step in tiered.after:
            moved += self._step(step)
        return moved

    def _step(self, step: TierCopy) -> int:
        pair = (step.src.medium(), step.dst.medium())
        try:
            n = self._copy(step.src, step.dst)
        except Exception as exc:
            with self._stats_lock:
                if step.required:
                    self.stats.required_failures += 1
                else:
                    self.stats.best_effort_failures += 1
            if step.required:
                raise
            with self._stats_lock:
                self._failing[pair] += 1
                first = self._failing[pair] == 1
            if first:
                logger.warning(
                    "best-effort %s -> %s copies are failing (%s); counted until they "
                    "succeed again",
                    *pair,
                    exc,
                )
            return 0
        with self._stats_lock:
            self.stats.blocks[pair] += len(step.src)  # type: ignore[arg-type]
            self.stats.bytes[pair] += n
            failed = self._failing.pop(pair, 0)
        if failed:
            logger.warning(
                "best-effort %s -> %s copies succeed again after %d failed", *pair, failed
            )
        return n

    def _copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        if src.medium() == CPU:
            return self.lower[dst.medium()].copy(src, dst)
        if dst.medium() == CPU:
            return self.lower[src.medium()].copy(src, dst)
        return self._move(src, dst)

    def _move(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        """One lower tier's blocks into another's (keys and order as ``src``); what can be
        read is written, and the copy fails unless every block moved."""
        reader, writer = self.lower[src.medium()], self.lower[dst.medium()]
        data, hit = reader.read_blocks(src)
        found = [i for i, h in enumerate(hit) if h]
        keys = [reader.keys_of(src)[i] for i in found]
        where = [[int(w[i]) for i in found] for w in writer.placement(dst)]
        ok = writer.write_blocks(keys, data[found], *where)
        if len(keys) < len(hit) or not all(ok):
            raise BlocksMissing(f"{len(hit) - sum(ok)} of {len(hit)} blocks not moved")
        return len(keys) * reader.store.block_bytes

    def _gpu_copy(self, spec: TransferSpec) -> int:
        sub_id = next(self._sub_ids)
        self.cpu_gpu.submit(sub_id, spec)
        while True:
            self.cpu_gpu.wait([sub_id], _SUB_WAIT_S)
            with self._sub_lock:
                for r in self.cpu_gpu.get_finished():
                    self._sub_results[r.job_id] = r
                result = self._sub_results.pop(sub_id, None)
            if result is not None:
                break
        if not result.success:
            raise RuntimeError(f"{spec.media[0]} -> {spec.media[1]} copy failed: {result.error}")
        pair = spec.media
        with self._stats_lock:
            self.stats.blocks[pair] += len(spec.src)  # type: ignore[arg-type]
            self.stats.bytes[pair] += result.num_bytes
        return result.num_bytes

    def close(self) -> None:
        super().close()
        self.cpu_gpu.close()
        for pair, failed in self._failing.items():
            logger.warning("best-effort %s -> %s copies: %d failed at close", *pair, failed)
