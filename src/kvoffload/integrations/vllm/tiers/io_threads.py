"""The I/O side of a kvoffload tier inside vLLM: jobs of bytes and the threads that run them."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobId


@dataclass
class IOJob:
    """One job's bytes to move; built on the scheduler thread, run on an I/O thread.

    ``keys[i]`` goes to / comes from primary chunk ``chunks[i]``; ``slots`` is
    the tier's own placement (disk slots), when it has one. ``ok`` is filled
    in by the I/O thread, one flag per key.
    """

    job_id: JobId
    is_load: bool
    keys: list[OffloadKey]
    chunks: list[int]
    slots: list[int] | None = None
    #: Every key of the vLLM job (a load may have dropped some before the I/O).
    job_keys: list[OffloadKey] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""


class IOThreads:
    """A few threads running ``IOJob``s, loads first; finished jobs in a queue."""

    def __init__(self, name: str, num_threads: int, run: Any) -> None:
        self._run = run
        self._loads: deque[IOJob] = deque()
        self._stores: deque[IOJob] = deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._stop = False
        self.finished: deque[IOJob] = deque()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-io{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: IOJob) -> None:
        with self._cond:
            if self._stop:
                job.ok = [False] * len(job.keys)
                job.error = "tier shut down"
                self.finished.append(job)
                return
            self._inflight += 1
            (self._loads if job.is_load else self._stores).append(job)
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._loads or self._stores)
                if self._loads:
                    job = self._loads.popleft()
                elif self._stores:
                    job = self._stores.popleft()
                else:
                    return
            start = time.perf_counter()
            try:
                job.ok = [bool(x) for x in self._run(job)]
            except Exception as exc:  # the job fails; the tier keeps serving
                job.ok = [False] * len(job.keys)
                job.error = f"{type(exc).__name__}: {exc}"
            job.seconds = time.perf_counter() - start
            with self._cond:
                self.finished.append(job)
                self._inflight -= 1
                self._cond.notify_all()

    def wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def stop(self) -> None:
        """Finish the jobs queued so far, then end the threads."""
        self.wait_idle()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
