"""``OffloadingWorker``: the one asynchronous job API, routing to per-tier handlers.

Handlers are registered by (source medium, destination medium); the GPU<->CPU
handler comes with ``for_cpu_tier`` and other tiers (disk, Redis) plug theirs
in with ``register_handler``. The worker adds no policy: it executes specs.

Invariants: a job id is in use from submit until ``get_finished`` returns
its result, and every submitted job gets exactly one result, including jobs
no handler accepts (reported failed, never raised).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from kvoffload.offload.base import LoadStoreSpec
from kvoffload.transfer.copy_plan import Span
from kvoffload.transfer.cuda_streams import CudaStreamTransferHandler
from kvoffload.transfer.gpu_cpu import CPU, GPU, CpuGpuTransferHandler, GpuCpuJobPlanner
from kvoffload.transfer.handler import ThreadPoolTransferHandler, TransferHandler, can_stage
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferResult, TransferSpec, as_transfer_spec

SpecLike = TransferSpec | tuple[LoadStoreSpec, LoadStoreSpec]


def make_cpu_gpu_handler(
    gpu_tensors: Sequence[torch.Tensor],
    layout: KVLayout,
    host_pool: HostPool,
    num_threads: int = 2,
    strategy: str | None = None,
) -> TransferHandler:
    """The GPU<->CPU handler for these tensors: CUDA streams on a GPU, threads otherwise."""
    planner = GpuCpuJobPlanner(gpu_tensors, layout, host_pool)
    if planner.device.type == "cuda":
        return CudaStreamTransferHandler(planner, strategy=strategy)
    return CpuGpuTransferHandler(planner, num_threads, strategy)


class OffloadingWorker:
    """Routes jobs to handlers by media; ``submit_*`` return at once, results are polled.

    Not meant to be shared between threads: the engine loop owns it.
    """

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], TransferHandler] = {}
        self._job_handler: dict[int, TransferHandler | None] = {}  # None: rejected here
        self._rejected: list[TransferResult] = []

    @classmethod
    def for_cpu_tier(
        cls,
        gpu_tensors: Sequence[torch.Tensor],
        layout: KVLayout,
        host_pool: HostPool,
        num_threads: int = 2,
    ) -> OffloadingWorker:
        """A worker with the GPU<->CPU handler registered both ways."""
        worker = cls()
        handler = make_cpu_gpu_handler(gpu_tensors, layout, host_pool, num_threads)
        worker.register_handler(GPU, CPU, handler)
        worker.register_handler(CPU, GPU, handler)
        return worker

    def register_handler(self, src_medium: str, dst_medium: str, handler: TransferHandler) -> None:
        """Send (src_medium -> dst_medium) jobs to ``handler``; one handler per pair."""
        key = (src_medium, dst_medium)
        if key in self._handlers:
            raise ValueError(f"a handler for {src_medium} -> {dst_medium} is already registered")
        if not isinstance(handler, TransferHandler):
            raise TypeError(f"handler must be a TransferHandler, got {type(handler).__name__}")
        self._handlers[key] = handler

    @property
    def handlers(self) -> dict[tuple[str, str], TransferHandler]:
        return dict(self._handlers)

    def _unique_handlers(self) -> list[TransferHandler]:
        seen: dict[int, TransferHandler] = {}
        for h in self._handlers.values():
            seen.setdefault(id(h), h)
        return list(seen.values())

    # -- jobs -------------------------------------------------------------------

    def submit(self, job_id: int, spec: SpecLike) -> None:
        """Start a job in either direction; returns at once."""
        self._submit(job_id, spec, None)

    def submit_store(self, job_id: int, spec: SpecLike) -> None:
        """Start a store (GPU -> a tier); a spec from another medium is reported failed."""
        self._submit(job_id, spec, "store")

    def submit_load(
        self,
        job_id: int,
        spec: SpecLike,
        expedited: bool = False,
        stages: Sequence[Sequence[Span]] | None = None,
    ) -> None:
        """Start a load (a tier -> GPU); a spec to another medium is reported failed.

        ``expedited``: the caller waits for it next (see ``TransferHandler``).
        ``stages``: copy it stage by stage (``submit_staged``) where its handler
        can, so that ``wait_stage`` can return before the whole job is done.
        """
        self._submit(job_id, spec, "load", expedited, stages)

    def wait_stage(self, job_id: int, stage: int) -> None:
        """Return once stage ``stage`` of a staged load is done; at once for any other job."""
        handler = self._job_handler.get(job_id)
        if isinstance(handler, ThreadPoolTransferHandler):
            handler.wait_stage(job_id, stage)

    def _submit(
        self,
        job_id: int,
        spec: SpecLike,
        kind: str | None,
        expedited: bool = False,
        stages: Sequence[Sequence[Span]] | None = None,
    ) -> None:
        if job_id in self._job_handler:
            raise ValueError(f"job id {job_id} is already in use")
        ts = as_transfer_spec(spec)
        src, dst = ts.media
        error = None
        handler = self._handlers.get((src, dst))
        if kind == "store" and src != GPU:
            error = f"a store copies from GPU, this job copies {src} -> {dst}"
        elif kind == "load" and dst != GPU:
            error = f"a load copies into GPU, this job copies {src} -> {dst}"
        elif handler is None:
            known = ", ".join(f"{a}->{b}" for a, b in self._handlers) or "none"
            error = f"no handler registered for {src} -> {dst} (registered: {known})"
        if error is not None or handler is None:
            self._job_handler[job_id] = None
            self._rejected.append(TransferResult(job_id, False, error, 0, src, dst, 0.0))
            return
        self._job_handler[job_id] = handler
        if stages is not None and can_stage(handler):
            handler.submit_staged(job_id, ts, stages)
        else:
            handler.submit(job_id, ts, expedited)

    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call, each job exactly once."""
        out, self._rejected = self._rejected, []
        for h in self._unique_handlers():
            out.extend(h.get_finished())
        for r in out:
            self._job_handler.pop(r.job_id, None)
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until none of ``job_ids`` is running; False if ``timeout`` expired first.

        Results stay queued for ``get_finished``; unknown ids are ignored.
        """
        by_handler: dict[int, tuple[TransferHandler, list[int]]] = {}
        for job_id in job_ids:
            h = self._job_handler.get(job_id)
            if h is not None:
                by_handler.setdefault(id(h), (h, []))[1].append(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        for h, ids in by_handler.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(ids, left):
                return False
        return True

    def num_in_flight(self) -> int:
        """Jobs submitted whose results ``get_finished`` has not returned yet."""
        return len(self._job_handler)

    def close(self) -> None:
        """Finish running jobs and close every handler."""
        for h in self._unique_handlers():
            h.close()

    def __enter__(self) -> OffloadingWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
