"""``chunk_rows.group_rows``: vLLM's multi-group job specs resolved to one CPU sub-block per GPU
block, and what a job that does not fit its groups does (one warning, a failed job, no bytes)."""

from tests.vllm_required import need_vllm

need_vllm()

import logging  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from kvoffload.integrations.vllm.scheduler.manager import KVOffloadJobSpec  # noqa: E402
from kvoffload.integrations.vllm.worker.chunk_rows import group_rows  # noqa: E402
from kvoffload.integrations.vllm.worker.worker import KVOffloadWorker  # noqa: E402
from kvoffload.offload import CPULoadStoreSpec  # noqa: E402
from kvoffload.transfer import HostPool, KVGeometry, KVLayout  # noqa: E402


def test_each_group_starts_at_its_own_position_in_its_first_chunk() -> None:
    # f = 2. Group 0: 3 GPU blocks from block index 4 (chunk position 0): chunks 7, 8.
    # Group 1: 3 blocks from block index 5 (position 1): chunks 3, 5. Group 2: none.
    rows = group_rows([10, 11, 12, 20, 21, 22], [3, 3, 0], [4, 5, 9], [7, 8, 3, 5], 2)
    assert rows.gpu.tolist() == [10, 11, 12, 20, 21, 22]
    assert rows.sub_blocks.tolist() == [14, 15, 16, 7, 10, 11]
    assert rows.groups == (0, 1) and rows.starts == (0, 3, 6)


def test_one_group_without_sizes_skips_the_first_chunks_leading_sub_blocks() -> None:
    rows = group_rows([1, 2, 3], None, None, [4, 6], 2)
    assert rows.sub_blocks.tolist() == [9, 12, 13]


@pytest.mark.parametrize(
    ("gpu", "sizes", "firsts", "chunks"),
    [
        ([1, 2, 3], [2, 2], [0, 0], [0, 1]),  # sizes do not add up to the GPU blocks
        ([1, 2, 3, 4], [2, 2], [0, 1], [0, 1]),  # group 1 from position 1 needs 2 chunks
        ([1, 2], [1, 1], [0, 0], [0, 1, 2]),  # a chunk too many
        ([1, 2], [1, 1], [0], [0, 1]),  # block indices of one group for two
    ],
)
def test_a_job_that_does_not_fit_its_groups_is_a_value_error(
    gpu: list[int], sizes: list[int], firsts: list[int], chunks: list[int]
) -> None:
    with pytest.raises(ValueError):
        group_rows(gpu, sizes, firsts, chunks, 2)


def test_the_worker_fails_such_a_job_with_one_warning_and_writes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = KVLayout(KVGeometry(2, 1, 4, 1, torch.uint8), "kv_split")
    gpu = layout.allocate(8)
    for t in gpu:
        t.fill_(7)
    pool = HostPool(layout, 4, 2, pin_memory=False)
    pool.region.zero_()
    worker = KVOffloadWorker(layout, gpu, pool, num_threads=1)
    bad = GPULoadStoreSpec([1, 2, 3], group_sizes=[2, 1], block_indices=[0, 1])
    with caplog.at_level(logging.WARNING, logger="vllm.kvoffload"):
        worker.submit_store(5, bad, KVOffloadJobSpec(CPULoadStoreSpec([0]), -1))
        assert worker.wait_all(timeout=30)
        (result,) = worker.get_finished()
    assert result.job_id == 5 and not result.success
    assert not pool.region.any()
    lines = [r.getMessage() for r in caplog.records if "refusing a transfer job" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    good = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[2, 2], block_indices=[0, 2])
    worker.submit_store(6, good, KVOffloadJobSpec(CPULoadStoreSpec([3, 1]), -1))
    assert worker.wait_all(timeout=30)
    (result,) = worker.get_finished()
    assert result.success and np.all(pool.read_slots([3, 1]).numpy() == 7)
    worker.shutdown()
