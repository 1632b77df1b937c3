"""The CPU tier hands a store its slots in runs a copy can take whole.

A store that reuses slots freed together gets them ascending in key order,
so a job whose GPU block ids also run upwards (a request's blocks, allocated
together) is one slice copy per run (``copy_plan``'s ``runs``), not one copy
per block. Handed out in the order a LIFO free list pops them, slots evicted
oldest first (blocks stored one at a time, as a decode's are) came back
descending, and every pair of such a job was a run of its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.offload import CPUOffloadingManager, OffloadKey
from kvoffload.transfer import RowPairs
from tests.offload.keyutil import key


def _store(m: CPUOffloadingManager, ks: list[OffloadKey]) -> list[int]:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(ks, success=True)
    return [int(s) for s in out.store_spec.block_ids]


@pytest.mark.parametrize("policy", ["lru", "arc", "queue_arms"])
def test_slots_evicted_oldest_first_come_back_ascending(policy: str) -> None:
    m = CPUOffloadingManager(8, cache_policy=policy)
    for i in range(8):  # one block per store: each its own chain, evicted oldest first
        _store(m, [key(1000 * i)])
    slots = _store(m, [key(i) for i in range(100, 104)])
    assert slots == [0, 1, 2, 3]
    gpu_ids = np.arange(40, 44)  # a request's blocks, allocated together
    assert len(RowPairs.build(gpu_ids, np.asarray(slots)).run_starts) == 1


def test_a_chain_evicted_tail_first_comes_back_ascending_too() -> None:
    m = CPUOffloadingManager(16, cache_policy="lru")
    _store(m, [key(i) for i in range(16)])
    assert _store(m, [key(i) for i in range(100, 106)]) == list(range(10, 16))
