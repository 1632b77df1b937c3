"""GPU<->CPU jobs on dedicated CUDA streams, completion tracked by events.

``submit`` validates the job and *enqueues* its copies on a transfer stream
(one for stores, one for loads, so a load never queues behind a long store,
and one for expedited loads, which must not queue behind the others),
after making that stream wait for the work already queued on the current
(compute) stream: a store must see the KV the model just wrote, and a load
must not overwrite blocks a queued kernel still reads. An event recorded
after the copies marks completion; ``get_finished`` polls events and
``wait`` synchronises on them. Host memory is touched only by DMA copies of
slices (see ``copy_plan``), so with a pinned host pool nothing blocks the CPU.

The stream API is injected (``torch.cuda`` by default) so the bookkeeping is
exercised on CPU-only machines with a stand-in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from kvoffload.transfer.copy_plan import copy_rows
from kvoffload.transfer.gpu_cpu import GpuCpuJobPlanner
from kvoffload.transfer.handler import TransferHandler, job_result
from kvoffload.transfer.spec import TransferResult, TransferSpec

# A lower number is a higher priority in CUDA and 0 is the lowest level
# (that of ordinary streams): copies never take precedence over compute.
TRANSFER_STREAM_PRIORITY = 0


class CudaStreamTransferHandler(TransferHandler):
    """Asynchronous GPU<->CPU copies on low-priority streams; see the module docstring.

    Not thread-safe: it is driven from the engine loop (as ``OffloadingWorker`` is).
    """

    def __init__(
        self,
        planner: GpuCpuJobPlanner,
        stream_api: Any = None,
        strategy: str | None = None,
    ) -> None:
        self.planner = planner
        self.api = torch.cuda if stream_api is None else stream_api
        self.strategy = strategy
        device = planner.device
        self._streams = {
            "store": self.api.Stream(device=device, priority=TRANSFER_STREAM_PRIORITY),
            "load": self.api.Stream(device=device, priority=TRANSFER_STREAM_PRIORITY),
            "expedited": self.api.Stream(device=device, priority=TRANSFER_STREAM_PRIORITY),
        }
        # job id -> (event, spec, bytes, submit time); dict order is submit order.
        self._pending: dict[int, tuple[Any, TransferSpec, int, float]] = {}
        self._done: list[TransferResult] = []
        self._closed = False

    def submit(self, job_id: int, spec: TransferSpec, expedited: bool = False) -> None:
        if self._closed:
            raise RuntimeError("transfer handler is closed")
        if job_id in self._pending or any(r.job_id == job_id for r in self._done):
            raise ValueError(f"job id {job_id} is already in use")
        start = time.perf_counter()
        try:
            job = self.planner.plan(spec)
            lane = "expedited" if expedited and job.direction == "load" else job.direction
            stream = self._streams[lane]
            stream.wait_stream(self.api.current_stream(self.planner.device))
            with self.api.stream(stream):
                copy_rows(job.groups, job.pairs, self.strategy, non_blocking=True)
                event = self.api.Event()
                event.record(stream)
        except Exception as exc:
            # Copies already enqueued for this job may still land; the job is
            # reported failed, so its destination is never treated as valid.
            self._done.append(self._result(job_id, spec, start, 0, exc))
            return
        self._pending[job_id] = (event, spec, job.num_bytes, start)

    def _result(
        self,
        job_id: int,
        spec: TransferSpec,
        start: float,
        num_bytes: int,
        exc: BaseException | None,
    ) -> TransferResult:
        return job_result(job_id, spec.media, start, num_bytes, exc)

    def _settle(self, job_id: int, block: bool) -> bool:
        """Move ``job_id`` to done if its event completed (waiting for it if ``block``)."""
        event, spec, num_bytes, start = self._pending[job_id]
        try:
            if block:
                event.synchronize()
            elif not event.query():
                return False
        except Exception as exc:  # an asynchronous CUDA error surfaces here
            self._done.append(self._result(job_id, spec, start, 0, exc))
        else:
            self._done.append(self._result(job_id, spec, start, num_bytes, None))
        del self._pending[job_id]
        return True

    def get_finished(self) -> list[TransferResult]:
        for job_id in list(self._pending):
            self._settle(job_id, block=False)
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            if job_id not in self._pending:
                continue
            if deadline is None:
                self._settle(job_id, block=True)
                continue
            while not self._settle(job_id, block=False):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(50e-6)
        return True

    def close(self) -> None:
        self.wait(list(self._pending))
        self._closed = True
