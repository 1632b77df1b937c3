"""``bench transfer``'s block id patterns: distinct ids in range, and the runs each promises."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.bench.transfer.child import CHAIN_BLOCKS, SLOT_RUN, block_ids
from kvoffload.transfer import RowPairs


@pytest.mark.parametrize("pattern", ["random", "chains", "sequential"])
@pytest.mark.parametrize(("pool", "n"), [(1125, 1000), (127, 113), (9, 8), (2, 1)])
def test_ids_are_distinct_and_in_range(pattern: str, pool: int, n: int) -> None:
    gpu, slots = block_ids(pattern, pool, n, np.random.default_rng(0))
    for ids in (gpu, slots):
        assert ids.size == n == np.unique(ids).size
        assert ids.min() >= 0 and ids.max() < pool


def test_chains_are_request_chains_and_slot_runs() -> None:
    gpu, slots = block_ids("chains", 1125, 1000, np.random.default_rng(0))
    steps = np.abs(np.diff(gpu.reshape(-1)[: 62 * CHAIN_BLOCKS].reshape(62, CHAIN_BLOCKS)))
    assert (steps == 1).all()  # each chain is consecutive, up or down
    assert {int(c[1] - c[0]) for c in gpu[: 62 * CHAIN_BLOCKS].reshape(62, -1)} == {1, -1}
    assert (np.diff(slots[:SLOT_RUN]) == 1).all()
    store = RowPairs.build(gpu, slots)
    assert len(store.dst_run_starts) <= 1000 // SLOT_RUN + 1  # a few destination runs
    assert (
        len(RowPairs.build(*block_ids("random", 1125, 1000, np.random.default_rng(0))).run_starts)
        > 900
    )
