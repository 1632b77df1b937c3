"""``run_on_wait``: a waited job that no pool thread has started runs on the waiting thread.

A synchronous CPU-tier load is waited for as soon as it is submitted; handing
it to a pool thread and sleeping until that thread gets a core cost ~9 ms per
load on a busy 2-core machine. Each part must still run exactly once.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
import torch

from kvoffload.transfer import GpuCpuJobPlanner, HostPool, KVGeometry, KVLayout, gpu_cpu
from kvoffload.transfer.gpu_cpu import SHARD_MIN_BYTES, CpuGpuTransferHandler
from kvoffload.transfer.handler import ThreadPoolTransferHandler, Work
from kvoffload.transfer.spec import TransferSpec
from tests.transfer.test_worker import load, make, random_fill, settle


class Recorder(ThreadPoolTransferHandler):
    """Job 1 blocks the only pool thread until the gate opens; every job records its thread."""

    run_on_wait = True

    def __init__(self) -> None:
        super().__init__(num_threads=1)
        self.gate = threading.Event()
        self.ran: list[tuple[int, str]] = []

    def prepare(self, job_id: int, spec: TransferSpec) -> list[Work]:
        def work(part: int) -> int:
            if job_id == 1:
                self.gate.wait(30)
            self.ran.append((job_id, threading.current_thread().name))
            return 1

        return [lambda p=p: work(p) for p in range(3)]


def _spec() -> TransferSpec:
    return load([0], [1])


def test_a_waited_job_runs_on_the_waiting_thread_while_the_pool_is_busy() -> None:
    handler = Recorder()
    handler.submit(1, _spec())  # its parts hold the pool thread
    handler.submit(2, _spec())
    done = threading.Event()
    waiter = threading.Thread(
        target=lambda: (handler.wait([2]), done.set()), name="waiter", daemon=True
    )
    waiter.start()
    # Without run_on_wait job 2 would wait behind the gated job 1 forever.
    assert done.wait(30), "wait() did not run the queued job itself"
    assert [name for job, name in handler.ran if job == 2] == ["waiter"] * 3
    handler.gate.set()
    handler.wait([1])
    results = {r.job_id: r for r in handler.get_finished()}
    assert results[1].success and results[2].success
    assert results[2].num_bytes == 3  # every part ran once
    assert sorted(job for job, _ in handler.ran) == [1, 1, 1, 2, 2, 2]
    handler.close()


def test_a_timed_wait_runs_nothing_itself() -> None:
    handler = Recorder()
    handler.submit(1, _spec())
    handler.submit(2, _spec())
    assert not handler.wait([2], timeout=0.01)
    assert all(name != threading.current_thread().name for _, name in handler.ran)
    handler.gate.set()
    handler.wait([1, 2])
    assert len(handler.get_finished()) == 2
    handler.close()


def test_loads_waited_at_once_copy_the_right_bytes() -> None:
    layout, gpu, pool, worker = make("kv_split", num_gpu=32, num_slots=32, threads=2)
    random_fill(pool.tensors, 5)
    rng = np.random.default_rng(2)
    with worker:
        for job in range(20):
            slots = rng.choice(32, size=6, replace=False).tolist()
            targets = rng.choice(32, size=6, replace=False).tolist()
            worker.submit_load(job, load(slots, targets))
            worker.wait([job])
            assert settle(worker, [job])[job].success
            for gp, hp in zip(layout.block_planes(gpu), layout.block_planes(pool.tensors)):
                for s, t in zip(slots, targets):
                    assert torch.equal(gp[t], hp[s])


def _pool_drained(handler: ThreadPoolTransferHandler) -> None:
    """Returns once the (single) pool thread has run everything queued before this call."""
    handler._pool.submit(lambda: None).result(timeout=30)


def test_an_expedited_job_is_left_to_the_waiting_thread() -> None:
    handler = Recorder()
    handler.gate.set()
    handler.submit(2, _spec(), expedited=True)
    _pool_drained(handler)
    # Handed to the pool, the idle pool thread would have run it by now.
    assert handler.ran == []
    handler.wait([2])
    assert [name for _, name in handler.ran] == [threading.current_thread().name] * 3
    assert handler.get_finished()[0].num_bytes == 3
    handler.close()


@pytest.mark.parametrize("then", ["get_finished", "submit", "timed_wait", "close"])
def test_an_expedited_job_nobody_waits_for_is_not_stranded(then: str) -> None:
    handler = Recorder()
    handler.gate.set()
    handler.submit(2, _spec(), expedited=True)
    if then == "get_finished":
        handler.get_finished()
    elif then == "submit":
        handler.submit(3, _spec())
    elif then == "timed_wait":
        handler.wait([9], timeout=0.001)
    else:
        handler.close()  # finishes what was handed over before it returns
        assert sorted(job for job, _ in handler.ran) == [2, 2, 2]
        return
    assert handler.wait([2, 3], timeout=30)
    assert all(name != threading.current_thread().name for _, name in handler.ran)
    assert 2 in {r.job_id for r in handler.get_finished()}
    handler.close()


def test_an_expedited_load_is_one_part_of_the_right_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # A waiter with a team of its own (a waiter without one has its job sharded: the
    # test process's main thread may have been set to one torch thread by earlier tests).
    monkeypatch.setattr(gpu_cpu, "_team_size", lambda: 2)
    # Big enough to be split across the pool threads were it not expedited.
    layout = KVLayout(KVGeometry(4, 8, 64, 16, torch.float16), "layer_first")
    gpu = layout.allocate(96)
    pool = HostPool(layout, 96)
    random_fill(pool.tensors, 3)
    handler = CpuGpuTransferHandler(GpuCpuJobPlanner(gpu, layout, pool), num_threads=2)
    slots, targets = list(range(10, 74)), list(range(30, 94))
    assert len(slots) * layout.bytes_per_block >= SHARD_MIN_BYTES
    assert len(handler.prepare(1, load(slots, targets))) == 2  # the pool's way: one per thread
    handler.submit(2, load(slots, targets), expedited=True)
    assert len(handler._unclaimed[2]) == 1
    handler.wait([2])
    (result,) = handler.get_finished()
    assert result.success and result.num_bytes == len(slots) * layout.bytes_per_block
    for gp, hp in zip(layout.block_planes(gpu), layout.block_planes(pool.tensors)):
        assert torch.equal(gp[30:94], hp[10:74])
    handler.close()


class Staged(Recorder):
    """Recorder whose staged jobs are one part per stage, each recording its stage."""

    supports_stages = True

    def __init__(self) -> None:
        super().__init__()
        self.stages_ran: list[tuple[int, str]] = []

    def prepare_staged(self, job_id: int, spec: TransferSpec, stages) -> list[Work]:
        def work(k: int) -> int:
            self.stages_ran.append((k, threading.current_thread().name))
            return 1

        return [lambda k=k: work(k) for k in range(len(stages))]


def test_a_staged_job_runs_its_stages_in_order_on_one_pool_thread() -> None:
    handler = Staged()
    handler.gate.set()
    handler._pool = concurrent.futures.ThreadPoolExecutor(2)  # two threads to spread over
    tasks: list[object] = []
    real_submit = handler._pool.submit
    handler._pool.submit = lambda *a: tasks.append(a) or real_submit(*a)  # type: ignore[method-assign]
    handler.submit_staged(5, _spec(), [[0], [1], [2], [3]])
    assert len(tasks) == 1  # one thread copies while the engine computes on the others
    assert handler.wait([5], timeout=30)
    assert [k for k, _ in handler.stages_ran] == [0, 1, 2, 3]
    assert len({name for _, name in handler.stages_ran}) == 1
    assert handler.get_finished()[0].num_bytes == 4
    handler.close()


def test_waiting_for_a_stage_runs_it_here_when_the_pool_is_busy() -> None:
    handler = Staged()  # its one pool thread is held by job 1 until the gate opens
    handler.submit(1, _spec())
    handler.submit_staged(2, _spec(), [[0], [1], [2]])
    handler.wait_stage(2, 1)  # stages 0 and 1 are not started: 1 runs here, 0 stays queued
    here = threading.current_thread().name
    assert [(k, n) for k, n in handler.stages_ran] == [(1, here)]
    handler.wait_stage(2, 9)  # no such stage: returns at once
    handler.gate.set()
    assert handler.wait([1, 2], timeout=30)
    assert sorted(k for k, n in handler.stages_ran if n != here) == [0, 2]
    results = {r.job_id: r for r in handler.get_finished()}
    assert results[2].success and results[2].num_bytes == 3
    handler.wait_stage(2, 0)  # a finished job: returns at once
    handler.close()


@pytest.mark.parametrize("kind", ["layer_first", "kv_split", "cross_layer"])
def test_stages_copied_one_by_one_copy_the_right_bytes(kind: str) -> None:
    """Whole planes of a stage are one fused copy, part rows a span copy each, the rest a
    last part: together exactly the job's bytes."""
    layout = KVLayout(KVGeometry(2, 2, 8, 4, torch.float16), kind)
    gpu = layout.allocate(16)
    pool = HostPool(layout, 16)
    random_fill(pool.tensors, 6)
    random_fill(gpu, 7)
    before = [p.clone() for p in layout.block_planes(gpu)]
    handler = CpuGpuTransferHandler(GpuCpuJobPlanner(gpu, layout, pool), num_threads=2)
    row = layout.plane_row_bytes
    last = layout.num_planes - 1
    stages = [[(0, 0, row)], [(last, row // 2, row)]]
    if layout.num_planes == 1:
        stages = [[(0, 0, row // 4)], [(0, row // 2, row)]]
    elif layout.num_planes > 2:
        stages.insert(1, [(1, 0, row), (2, 0, row)])
    slots, targets = [3, 9, 4, 12, 13], [7, 1, 2, 15, 8]
    handler.submit_staged(5, load(slots, targets), stages)
    assert handler.wait([5], timeout=30)  # no wait_stage: each stage on its own
    (result,) = handler.get_finished()
    assert result.success and result.num_bytes == len(slots) * layout.bytes_per_block
    for gp, hp, old in zip(layout.block_planes(gpu), layout.block_planes(pool.tensors), before):
        for s, t in zip(slots, targets):
            assert torch.equal(gp[t], hp[s])
        untouched = [b for b in range(16) if b not in targets]
        assert torch.equal(gp[untouched], old[untouched])
    handler.close()
