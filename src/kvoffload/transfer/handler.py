"""The handler interface every tier implements, and a thread-pool base for CPU-side copies.

A handler executes jobs for one or more (source medium, destination medium)
pairs. Contract, which ``OffloadingWorker`` relies on:

- ``submit`` returns promptly and never raises for a bad *job*: a job that
  cannot run is reported by ``get_finished`` as ``success=False``. It raises
  only for misuse (a job id already in use, a closed handler).
- Each submitted job id is reported exactly once by ``get_finished``; the id
  is in use from ``submit`` until then.
- ``wait(job_ids)`` returns when none of those jobs is still running (their
  results may still be waiting for ``get_finished``); unknown ids are
  ignored. It returns False if ``timeout`` expired first.
- ``submit(..., expedited=True)`` promises that the caller waits for the job
  next (a synchronous load, whose request computes in this step): the
  handler may run it on the waiting thread and must not queue it behind jobs
  submitted without the flag. The job is still reported by ``get_finished``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeGuard

from kvoffload.transfer.copy_plan import Span
from kvoffload.transfer.spec import TransferResult, TransferSpec


def describe_error(exc: BaseException) -> str:
    """One line naming the exception type and message, for ``TransferResult.error``."""
    return f"{type(exc).__name__}: {exc}"


def job_result(
    job_id: int,
    media: tuple[str, str],
    start: float,
    num_bytes: int,
    exc: BaseException | None,
    copy: tuple[float, float] | None = None,
) -> TransferResult:
    """The result of a job submitted at ``start`` (``time.perf_counter()``), finishing now.

    It failed with ``exc`` (reported as 0 bytes), or succeeded having moved ``num_bytes``;
    ``copy``: the wall and CPU seconds its copies ran (``TransferResult.copy_seconds``).
    """
    return TransferResult(
        job_id=job_id,
        success=exc is None,
        error=None if exc is None else describe_error(exc),
        num_bytes=num_bytes if exc is None else 0,
        src_medium=media[0],
        dst_medium=media[1],
        seconds=time.perf_counter() - start,
        copy_seconds=None if copy is None else copy[0],
        copy_cpu_seconds=None if copy is None else copy[1],
    )


class TransferHandler(ABC):
    """Executes transfer jobs asynchronously; see the module docstring for the contract."""

    @abstractmethod
    def submit(self, job_id: int, spec: TransferSpec, expedited: bool = False) -> None: ...

    @abstractmethod
    def get_finished(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool: ...

    def close(self) -> None:  # noqa: B027 - optional hook, most handlers hold no resources
        """Finish running jobs and release resources; the handler takes no more jobs."""


Work = Callable[[], int]


class ThreadPoolTransferHandler(TransferHandler):
    """Runs jobs on a small thread pool; subclasses supply ``prepare``.

    ``prepare(job_id, spec)`` runs inside ``submit``: it validates the job
    (raising for a bad one, before anything is written) and returns the work:
    one callable, or several independent ones (shards of a big job, run in
    parallel), each performing its copies and returning the bytes it moved.
    The job finishes when every shard has; it fails if any shard raised.

    ``run_on_wait`` (class attribute, off by default): ``wait`` without a
    timeout runs the waited jobs' parts that no pool thread has started yet
    on the calling thread, instead of sleeping until a pool thread gets to
    them. A synchronous load, waited for as soon as it is submitted, then
    costs no hand-off, and a busy or descheduled pool thread never holds it
    up. Each part runs exactly once (claimed under the lock), whoever runs it.

    With ``run_on_wait``, an expedited job (``prepare_expedited``'s parts)
    is not handed to the pool at all: the waiting thread runs it with that
    thread's own torch threads (the engine's, idle while it waits), where a
    pool thread would add a second team on the same cores. Should no wait
    name it, the next ``get_finished``, ``wait``, non-expedited ``submit`` or
    ``close`` hands it to the pool, so no job is ever stranded.

    Torch releases the GIL inside copies, so the threads copy in parallel.
    Each pool thread runs torch ops with ``intra_op_threads`` threads
    (default 1): parallelism comes from the pool, because a second OpenMP
    team per pool thread would spin on the same cores as the first and, on
    a small machine, cost more than it gives (measured: 4x slower on 2 cores).
    """

    run_on_wait: bool = False

    def __init__(
        self,
        num_threads: int = 2,
        thread_name_prefix: str = "kvoffload-xfer",
        intra_op_threads: int = 1,
    ) -> None:
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads <= 0:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(
            num_threads,
            thread_name_prefix=thread_name_prefix,
            initializer=_set_thread_intra_op,
            initargs=(intra_op_threads,),
        )
        self._parts_left: dict[int, int] = {}
        self._part_error: dict[int, BaseException] = {}
        self._part_bytes: dict[int, int] = {}
        self._part_copy: dict[int, list[float]] = {}  # job id -> [wall, CPU] seconds of parts
        self._cond = threading.Condition()
        self._in_use: set[int] = set()  # submitted, not yet returned by get_finished
        self._running: set[int] = set()  # submitted, not yet finished
        self._done: list[TransferResult] = []
        self._closed = False
        self._unclaimed: dict[int, list[_Part]] = {}  # job id -> parts nobody started
        self._held: list[_Part] = []  # expedited parts kept off the pool for the waiter
        self._stages: dict[int, list[_Part]] = {}  # staged job id -> its parts, in stage order

    @abstractmethod
    def prepare(self, job_id: int, spec: TransferSpec) -> Work | list[Work]: ...

    def prepare_expedited(self, job_id: int, spec: TransferSpec) -> Work | list[Work]:
        """``prepare`` for a job the caller waits for next; the same work by default."""
        return self.prepare(job_id, spec)

    def prepare_staged(
        self, job_id: int, spec: TransferSpec, stages: Sequence[Sequence[Span]]
    ) -> list[Work]:
        """The job as one part per stage, in order (see ``submit_staged``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot stage a job")

    #: Whether ``submit_staged`` works (``prepare_staged`` is implemented).
    supports_stages: bool = False

    def submit(self, job_id: int, spec: TransferSpec, expedited: bool = False) -> None:
        hold = expedited and self.run_on_wait
        prepare = self.prepare_expedited if hold else self.prepare
        self._enqueue(job_id, spec, lambda: prepare(job_id, spec), hold, staged=False)

    def submit_staged(
        self, job_id: int, spec: TransferSpec, stages: Sequence[Sequence[Span]]
    ) -> None:
        """Submit ``spec`` as one part per stage, started at once in stage order on one
        pool thread.

        ``stages[k]`` names the byte spans of the block rows part ``k`` copies
        (e.g. one attention layer's); no byte may be in two stages, and bytes in
        none are copied by one more part after the last stage.
        ``wait_stage(job_id, k)`` returns once part ``k`` is done, so a consumer
        can use the first stages while the rest copy. The job is reported by
        ``get_finished`` as one job, as any other.
        """
        self._enqueue(
            job_id, spec, lambda: self.prepare_staged(job_id, spec, stages), False, staged=True
        )

    def _enqueue(
        self,
        job_id: int,
        spec: TransferSpec,
        prepare: Callable[[], Work | list[Work]],
        hold: bool,
        staged: bool,
    ) -> None:
        start = time.perf_counter()
        if not hold:
            self._release_held()
        with self._cond:
            if self._closed:
                raise RuntimeError("transfer handler is closed")
            if job_id in self._in_use:
                raise ValueError(f"job id {job_id} is already in use")
            self._in_use.add(job_id)
            self._running.add(job_id)
        try:
            work = prepare()
        except Exception as exc:
            self._finish(job_id, spec, start, 0, exc)
            return
        parts = work if isinstance(work, list) else [work]
        if not parts:
            self._finish(job_id, spec, start, 0, None)
            return
        queued = [_Part(job_id, spec, w, start, len(parts) > 1) for w in parts]
        with self._cond:
            self._parts_left[job_id] = len(parts)
            self._part_bytes[job_id] = 0
            self._part_copy[job_id] = [0.0, 0.0]
            self._unclaimed[job_id] = list(queued)
            if staged:
                self._stages[job_id] = queued
            if hold:
                self._held.extend(queued)
                return
        if staged:
            # One pool thread takes the stages in order: the engine computes on the
            # other cores meanwhile, and a waiter runs any stage not started yet.
            self._pool.submit(self._run_in_order, queued)
            return
        for part in queued:
            self._pool.submit(self._run_claimed, part)

    def _run_in_order(self, parts: list[_Part]) -> None:
        for part in parts:
            self._run_claimed(part)

    def wait_stage(self, job_id: int, stage: int) -> None:
        """Return once stage ``stage`` of a staged job is done (run here if nobody started it).

        While another thread copies that stage, the waiting thread (idle
        otherwise: its forward pass needs the stage) copies the job's last
        stage nobody started, and so on until its stage is done: the pool
        thread goes front to back, the waiter back to front, and a load whose
        forward pass catches up with its copy is copied by two threads. A
        waiter returns at most one stage's copy after its stage is done.
        A job that is not staged, unknown or finished returns at once.
        """
        with self._cond:
            parts = self._stages.get(job_id)
            if parts is None or not 0 <= stage < len(parts):
                return
            part = parts[stage]
        if self._claim(part):
            self._run(part)
        while True:
            with self._cond:
                if part.done:
                    return
                left = self._unclaimed.get(job_id) or []
                spare = next((p for p in reversed(parts) if p in left), None)
                if spare is None:
                    self._cond.wait_for(lambda: part.done)
                    return
            if self._claim(spare):
                self._run(spare)

    def _release_held(self) -> None:
        """Hand expedited parts no wait has run to the pool (cheap when there are none)."""
        if not self._held:
            return
        with self._cond:
            held = [p for p in self._held if p in self._unclaimed.get(p.job_id, ())]
            self._held = []
        for part in held:
            self._pool.submit(self._run_claimed, part)

    def _claim(self, part: _Part) -> bool:
        """Take ``part`` for the calling thread; False if another thread already has."""
        with self._cond:
            left = self._unclaimed.get(part.job_id)
            if left is None or part not in left:
                return False
            left.remove(part)
            if not left:
                del self._unclaimed[part.job_id]
            return True

    def _run_claimed(self, part: _Part) -> None:
        if self._claim(part):
            self._run(part)

    def _run(self, part: _Part) -> None:
        job_id, num_bytes, error = part.job_id, 0, None
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            if part.shared and not getattr(_THIS_THREAD, "in_pool", False):
                with _one_torch_thread():
                    num_bytes = part.work()
            else:
                num_bytes = part.work()
        except BaseException as exc:  # a job must always be reported, whatever went wrong
            error = exc
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        with self._cond:
            part.done = True
            spent = self._part_copy[job_id]
            spent[0] += wall
            spent[1] += cpu
            if job_id in self._stages:
                self._cond.notify_all()
            self._part_bytes[job_id] += num_bytes
            if error is not None:
                self._part_error.setdefault(job_id, error)
            self._parts_left[job_id] -= 1
            if self._parts_left[job_id]:
                return
            del self._parts_left[job_id]
            self._stages.pop(job_id, None)
            total = self._part_bytes.pop(job_id)
            error = self._part_error.pop(job_id, None)
            copy = self._part_copy.pop(job_id)
        self._finish(job_id, part.spec, part.start, total, error, (copy[0], copy[1]))

    def _finish(
        self,
        job_id: int,
        spec: TransferSpec,
        start: float,
        num_bytes: int,
        exc: BaseException | None,
        copy: tuple[float, float] | None = None,
    ) -> None:
        media = spec.media if isinstance(spec, TransferSpec) else ("?", "?")
        result = job_result(job_id, media, start, num_bytes, exc, copy)
        with self._cond:
            self._done.append(result)
            self._running.discard(job_id)
            self._cond.notify_all()

    def get_finished(self) -> list[TransferResult]:
        self._release_held()
        with self._cond:
            done, self._done = self._done, []
            self._in_use.difference_update(r.job_id for r in done)
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        ids = set(job_ids)
        if self.run_on_wait and timeout is None:
            # A part run here cannot honour a timeout: only an unbounded wait helps.
            for job_id in ids:
                with self._cond:
                    parts = list(self._unclaimed.get(job_id, ()))
                # Last shard first: a pool thread waking meanwhile takes the queue's front
                # shard and finds it free, so the two copy at once (front first, the waiter
                # would take the very shard the waking thread pops, then the next).
                for part in reversed(parts):
                    self._run_claimed(part)
        self._release_held()
        with self._cond:
            return self._cond.wait_for(lambda: not (ids & self._running), timeout)

    def close(self) -> None:
        self._release_held()
        with self._cond:
            self._closed = True
        self._pool.shutdown(wait=True)


def can_stage(handler: TransferHandler | None) -> TypeGuard[ThreadPoolTransferHandler]:
    """Whether ``handler`` takes staged jobs (``submit_staged``)."""
    return isinstance(handler, ThreadPoolTransferHandler) and handler.supports_stages


class _Part:
    """One independent piece of a job's work, queued on the pool (identity-compared).

    ``shared``: the job has other parts, which other threads may run at the
    same time (shards of a big job, stages of a staged load).
    """

    __slots__ = ("done", "job_id", "shared", "spec", "start", "work")

    def __init__(
        self, job_id: int, spec: TransferSpec, work: Work, start: float, shared: bool = False
    ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.work = work
        self.start = start
        self.shared = shared
        self.done = False  # set under the handler's lock once the work ran


_THIS_THREAD = threading.local()


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run torch ops on this thread alone for the block's duration.

    A waiting thread that takes one part of a job while pool threads copy
    the others must not open its OpenMP team: the team's second thread would
    share a core with a pool thread, and every op's barrier would spin until
    the descheduled one caught up. Profiled on 2 cores (``bench transfer``,
    64 KiB blocks, run_on_wait with a 2-thread team): 34% of all samples in
    libgomp's barrier spin, store and load at about half of 14b0863's rate.
    (``torch.set_num_threads`` is per OpenMP thread and costs ~0.1 us.)
    """
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    _set_torch_threads(1)
    try:
        yield
    finally:
        _set_torch_threads(before)


def _set_torch_threads(num_threads: int) -> None:
    """``torch.set_num_threads`` for the calling thread, as torch defines it.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that
    only logs a warning (its engine threads are bound to cores), so through
    that name every call here would log once and leave the thread's team as
    it was; torch's builtin is what the name held before.
    """
    import torch

    torch._C.set_num_threads(num_threads)


_NEW_THREAD_DEFAULT = threading.Lock()


def _set_thread_intra_op(num_threads: int) -> None:
    """A pool thread's start: ``num_threads`` torch threads here, nothing changed elsewhere.

    OpenMP's thread count is per thread, so the engine's own threads keep
    theirs; but torch also records every count it is set to as the one a
    thread takes at its first torch call. Left so, one transfer pool would make
    every thread the process starts later (and a main thread that had not yet
    used torch) compute on ``num_threads`` threads; that record is put back.
    """
    import torch

    _THIS_THREAD.in_pool = True
    with _NEW_THREAD_DEFAULT:
        default = torch.get_num_threads()  # this thread's first torch call: the default
        _set_torch_threads(num_threads)
        if default != num_threads:
            # Only a set records it, and a set also sizes the caller's own team: a
            # thread of no use after it does the set.
            keeper = threading.Thread(target=_set_torch_threads, args=(default,))
            keeper.start()
            keeper.join()
