"""ChunkSplitHandler: offloaded blocks of f GPU blocks, one one-block host pool per position."""

from tests.vllm_required import need_vllm

need_vllm()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvoffload.integrations.vllm.worker.chunk_rows import ChunkSplitHandler  # noqa: E402
from kvoffload.offload import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.transfer import HostPool, KVGeometry, KVLayout  # noqa: E402
from kvoffload.transfer.spec import TransferSpec  # noqa: E402
from kvoffload.transfer.worker import make_cpu_gpu_handler  # noqa: E402

F, CHUNKS, ROW, PLANES = 3, 4, 8, 2


def rig() -> tuple[ChunkSplitHandler, list[torch.Tensor], torch.Tensor, KVLayout]:
    """GPU planes of 10 blocks; a shared buffer of CHUNKS rows, F pages per plane per row."""
    geometry = KVGeometry(PLANES, 1, ROW // 2, 1, torch.uint8)
    layout = KVLayout(geometry, "kv_split")
    gpu = layout.allocate(10)
    for p, t in enumerate(gpu):
        t.view(10, ROW).copy_(torch.arange(10 * ROW).view(10, ROW).to(torch.uint8) + 50 * p)
    row_stride = PLANES * F * ROW + 16
    buffer = torch.zeros(CHUNKS * row_stride, dtype=torch.uint8)
    areas = [
        torch.as_strided(buffer, (CHUNKS, F * ROW), (row_stride, 1), p * F * ROW)
        for p in range(PLANES)
    ]
    pools = [
        HostPool.over_tensors(
            layout, [a[:, j * ROW : (j + 1) * ROW].view(CHUNKS, 2, 1, 1, ROW // 2) for a in areas]
        )
        for j in range(F)
    ]
    handler = ChunkSplitHandler([make_cpu_gpu_handler(gpu, layout, p, 1) for p in pools])
    return handler, gpu, buffer.view(CHUNKS, row_stride), layout


def finish(handler: ChunkSplitHandler, job_id: int) -> bool:
    assert handler.wait([job_id], timeout=30)
    (result,) = handler.get_finished()
    assert result.job_id == job_id
    return result.success


def test_a_store_lays_each_chunk_out_as_vllm_does_and_a_skipping_load_reads_it_back() -> None:
    handler, gpu, rows, _ = rig()
    # Chunk 2 <- GPU blocks 4, 5, 6; chunk 0 <- 7, 8, 9.
    store = TransferSpec(GPULoadStoreSpec([4, 5, 6, 7, 8, 9]), CPULoadStoreSpec([2, 0]))
    handler.submit(1, store)
    assert finish(handler, 1)
    for chunk, blocks in ((2, [4, 5, 6]), (0, [7, 8, 9])):
        for p in range(PLANES):
            area = rows[chunk, p * F * ROW : (p + 1) * F * ROW]
            want = torch.cat([gpu[p].view(10, ROW)[b] for b in blocks])
            assert torch.equal(area, want)
    assert not rows[1].any() and not rows[3].any()
    # Load both chunks into fresh GPU blocks, skipping the first chunk's first sub-block.
    for t in gpu:
        t.view(10, ROW)[:5] = 0
    load = TransferSpec(CPULoadStoreSpec([2, 0]), GPULoadStoreSpec([0, 1, 2, 3, 4]))
    handler.submit(2, load)
    assert finish(handler, 2)
    for p in range(PLANES):
        plane = gpu[p].view(10, ROW)
        source = [5, 6, 7, 8, 9]  # blocks 5, 6 of chunk 2 (4 skipped), then chunk 0's
        for dst, src in enumerate(source):
            want = torch.arange(src * ROW, (src + 1) * ROW).to(torch.uint8) + 50 * p
            assert torch.equal(plane[dst], want), (p, dst)
    handler.close()


@pytest.mark.parametrize(
    "spec",
    [
        TransferSpec(GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0])),  # store: not whole chunks
        TransferSpec(CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([1, 2, 3])),  # load: skips > f-1
        TransferSpec(CPULoadStoreSpec([9]), GPULoadStoreSpec([1, 2, 3])),  # no such chunk
    ],
)
def test_a_job_that_cannot_run_fails_without_writing(spec: TransferSpec) -> None:
    handler, _, rows, _ = rig()
    handler.submit(7, spec)
    assert not finish(handler, 7)
    assert not rows.any()
    handler.close()


def test_an_empty_job_succeeds() -> None:
    handler, _, _, _ = rig()
    handler.submit(3, TransferSpec(GPULoadStoreSpec(np.zeros(0, np.int64)), CPULoadStoreSpec([])))
    assert finish(handler, 3)
    handler.close()
