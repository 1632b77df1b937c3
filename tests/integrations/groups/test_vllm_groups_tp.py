"""Hybrid KV cache groups (sliding window + full attention) at TP=2: two worker processes.

vLLM's real scheduler here, each rank's worker-side connector in its own
spawned process over its half of the KV heads (``vllm_groups_tp_rig``). With
the CPU tier alone each rank copies into its private host pools; with a disk
tier the CPU tier is vLLM's shared ``/dev/shm`` region (each row holds both
ranks' shards) and the disk tier lives in the scheduler process. Every block
a load wrote is checked, per rank, against what that rank computed.
"""

from tests.vllm_required import need_vllm

need_vllm()

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.integrations.vllm_groups_rig import serve_evict_return  # noqa: E402
from tests.integrations.vllm_groups_tp_rig import GroupsTPRig, GroupsWorkerPool  # noqa: E402
from tests.integrations.vllm_rig import CONNECTOR  # noqa: E402

# Two vLLM worker processes, imported once per module: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPT = list(range(1, 129))  # 8 full blocks


@pytest.fixture(scope="module")
def pool() -> Iterator[GroupsWorkerPool]:
    workers = GroupsWorkerPool(2)
    try:
        yield workers
    finally:
        workers.close()


@pytest.mark.parametrize(
    "lower",
    [{}, {"disk_bytes": "64MiB"}],
    ids=["cpu-tier", "disk-tier"],
)
def test_sliding_window_layout_at_tp2_loads_every_ranks_bytes_of_every_group(
    pool: GroupsWorkerPool, tmp_path: Path, lower: dict
) -> None:
    extra = {"cpu_bytes": "1MiB", **lower}
    if lower:
        extra["disk_dir"] = str(tmp_path / "disk")
    rig = GroupsTPRig.build(pool, tmp_path, "sliding_window", extra, CONNECTOR)
    try:
        serve_evict_return(rig, PROMPT)
        assert rig.first_computed["again"] > 0, "the returning prompt should hit the CPU tier"
        stats = rig.rank_stats()
        for rank, s in enumerate(stats):
            assert not s["mismatches"], f"rank {rank}: {s['mismatches']}"
            assert s["blocks_verified"] == rig.loaded_blocks > 0, rank
    finally:
        rig.shutdown()
