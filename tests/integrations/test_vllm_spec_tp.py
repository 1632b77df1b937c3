"""``KVOffloadConnector`` / ``OffloadingConnector`` + ``KVOffloadSpec`` with disk and Redis, TP=2.

vLLM's real scheduler runs here; two spawned worker processes (ranks 0 and 1)
each build the worker-side connector from the public names over CPU "GPU" KV
tensors holding half of the KV heads (``vllm_tp_rig``). The lower tiers live
in the scheduler process, on vLLM's shared ``/dev/shm`` region; each rank
copies its shard. Every block a load wrote is checked against what that rank
computed, so ``bytes_verified`` per rank is the bytes served back intact.
"""

from tests.vllm_required import need_vllm

need_vllm()

import os  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tests.conftest_redis import free_port  # noqa: E402
from tests.integrations.vllm_rig import BLOCK_SIZE  # noqa: E402
from tests.integrations.vllm_tp_rig import TPRig, WorkerPool  # noqa: E402

# Two vLLM worker processes, imported once per module: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TP = 2
PROMPT = list(range(1, 81))  # 5 full blocks
PROMPT_BLOCKS = len(PROMPT) // BLOCK_SIZE
RANK_BLOCK_BYTES = 2 * 1024  # per rank: 2 layers x 16 tokens x 1 KV head x 16 x fp16 x (K, V)
ROW_BYTES = 4096  # a shared-region row: both ranks' shards, page-aligned
STOCK = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
STOCK_SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm"}


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool(TP)
    try:
        yield workers
    finally:
        workers.close()


def flood(rig: TPRig, n: int = 3) -> None:
    """Unrelated prompts: enough to push PROMPT out of the GPU tier and the 6-row CPU tier."""
    for i in range(n):
        rig.add([1000 + 100 * i + j for j in range(len(PROMPT))], req_id=f"flood{i}")
    rig.run()


def serve_again(rig: TPRig, req_id: str) -> int:
    """PROMPT plus two tokens; the tokens computed when it was first scheduled."""
    rig.add([*PROMPT, 5, 6], req_id=req_id)
    rig.run()
    return rig.first_computed[req_id]


def lookup_report(rig: TPRig, record_property: Any, name: str) -> None:
    manager = rig.manager
    per_step = manager.lookup_seconds / max(rig.steps, 1)
    record_property(f"{name}_lookup_seconds_total", round(manager.lookup_seconds, 6))
    record_property(f"{name}_lookup_seconds_per_step", round(per_step, 7))
    print(
        f"{name}: {manager.lookup_calls} lookups on the scheduler thread, "
        f"{manager.lookup_seconds * 1e3:.2f} ms in all, {per_step * 1e6:.1f} us per step "
        f"over {rig.steps} steps"
    )


def assert_promoted_from_tier_0(rig: TPRig, blocks: int) -> None:
    """Some of the ``blocks`` came from the first lower tier, none from another. (How many
    the CPU tier kept through the flood depends on its policy; every block's bytes are
    checked on both ranks either way.)"""
    promoted = rig.manager.promotions_by_tier
    assert set(promoted) == {0}
    assert 0 < promoted[0] <= blocks


def assert_served_on_both_ranks(rig: TPRig, blocks: int, before: list[dict[str, Any]]) -> None:
    for rank, (now, then) in enumerate(zip(rig.rank_stats(), before)):
        assert now["mismatches"] == [], f"rank {rank} got another block's bytes"
        assert now["bytes_verified"] - then["bytes_verified"] == blocks * RANK_BLOCK_BYTES, rank
        assert now["failed_jobs"] == 0


def test_disk_serves_an_evicted_prefix_to_both_ranks(
    pool: WorkerPool, tmp_path: Path, record_property: Any
) -> None:
    extra = {"cpu_bytes": 6 * ROW_BYTES, "disk_dir": str(tmp_path / "disk"), "disk_bytes": "1MiB"}
    os.makedirs(extra["disk_dir"])
    rig = TPRig.build(pool, tmp_path, extra)
    try:
        rig.add(PROMPT, req_id="first")
        rig.run()
        flood(rig)
        before = rig.rank_stats()
        assert serve_again(rig, "again") == len(PROMPT)
        assert_promoted_from_tier_0(rig, PROMPT_BLOCKS)  # tier 0: the disk
        assert_served_on_both_ranks(rig, PROMPT_BLOCKS, before)
        lookup_report(rig, record_property, "disk")
    finally:
        rig.shutdown()


def test_offloaded_blocks_of_two_gpu_blocks_come_back_from_disk(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """``block_size`` 32 over 16-token GPU blocks: each shared row holds two GPU blocks a rank."""
    extra = {
        "cpu_bytes": 3 * 2 * ROW_BYTES,
        "disk_dir": str(tmp_path / "disk"),
        "disk_bytes": "1MiB",
        "block_size": 2 * BLOCK_SIZE,
    }
    os.makedirs(extra["disk_dir"])
    rig = TPRig.build(pool, tmp_path, extra)
    try:
        rig.add(PROMPT, req_id="first")
        rig.run()
        flood(rig)
        before = rig.rank_stats()
        chunks = len(PROMPT) // (2 * BLOCK_SIZE)
        assert serve_again(rig, "again") == chunks * 2 * BLOCK_SIZE
        assert_promoted_from_tier_0(rig, chunks)
        assert_served_on_both_ranks(rig, 2 * chunks, before)
    finally:
        rig.shutdown()


@pytest.mark.redis
def test_disk_then_redis_serve_an_evicted_prefix_to_both_ranks(
    pool: WorkerPool, tmp_path: Path, redis_server: Any, record_property: Any
) -> None:
    """One engine with disk and Redis serves from disk; a second one, Redis only, from Redis."""
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {
        "cpu_bytes": 6 * ROW_BYTES,
        "disk_dir": str(disk),
        "disk_bytes": "1MiB",
        "redis_url": redis_server.url,
    }
    rig = TPRig.build(pool, tmp_path, extra)
    try:
        rig.add(PROMPT, req_id="first")
        rig.run()
        flood(rig)
        before = rig.rank_stats()
        assert serve_again(rig, "again") == len(PROMPT)
        assert_promoted_from_tier_0(rig, PROMPT_BLOCKS)  # from disk (tier 0)
        assert_served_on_both_ranks(rig, PROMPT_BLOCKS, before)
        lookup_report(rig, record_property, "disk_and_redis")
    finally:
        rig.shutdown()
    # Another engine, vLLM's stock connector with KVOffloadSpec, Redis only: the
    # blocks the first engine wrote through to Redis come back to both ranks.
    redis_only = {**STOCK_SPEC, "cpu_bytes": 6 * ROW_BYTES, "redis_url": redis_server.url}
    rig = TPRig.build(pool, tmp_path, redis_only, connector=STOCK)
    try:
        before = rig.rank_stats()
        assert serve_again(rig, "from-redis") == len(PROMPT)
        assert rig.manager.promotions_by_tier == {0: PROMPT_BLOCKS}  # tier 0: Redis
        assert_served_on_both_ranks(rig, PROMPT_BLOCKS, before)
        lookup_report(rig, record_property, "redis")
    finally:
        rig.shutdown()


def test_a_corrupt_disk_block_is_a_miss_and_a_recompute(pool: WorkerPool, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {"cpu_bytes": 6 * ROW_BYTES, "disk_dir": str(disk), "disk_bytes": "1MiB"}
    rig = TPRig.build(pool, tmp_path, extra)
    try:
        rig.add(PROMPT, req_id="first")
        rig.run()
        flood(rig)
        files = [p for p in disk.rglob("*") if p.is_file() and p.stat().st_size >= 4096]
        assert files
        for path in files:
            path.write_bytes(os.urandom(path.stat().st_size))
        before = rig.rank_stats()
        rig.add([*PROMPT, 5, 6], req_id="again")
        rig.run()
        reasons = rig.finish_reasons()
        assert "error" not in reasons["again"].lower()
        # The disk was asked for the blocks the CPU tier lost in the flood; how many
        # it kept depends on its policy, and those (only those) may be served intact.
        from_disk = rig.manager.promotions_by_tier.get(0, 0)
        assert 0 < from_disk <= PROMPT_BLOCKS
        kept = (PROMPT_BLOCKS - from_disk) * RANK_BLOCK_BYTES
        for now, then in zip(rig.rank_stats(), before):
            assert now["mismatches"] == []  # never another block's bytes
            assert now["bytes_verified"] - then["bytes_verified"] <= kept  # none from disk
    finally:
        rig.shutdown()


def test_a_dead_redis_is_a_miss_not_an_error(
    pool: WorkerPool, tmp_path: Path, record_property: Any
) -> None:
    extra = {"cpu_bytes": 6 * ROW_BYTES, "redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    rig = TPRig.build(pool, tmp_path, extra)  # starts: the tier begins in an outage
    try:
        rig.add(PROMPT, req_id="first")
        rig.run()
        flood(rig)
        before = rig.rank_stats()
        served = serve_again(rig, "again")  # what the CPU tier kept through the flood, if any
        assert "error" not in rig.finish_reasons()["again"].lower()
        assert rig.manager.promotions_by_tier == {}
        for now, then in zip(rig.rank_stats(), before):
            assert now["mismatches"] == []
            assert now["bytes_verified"] - then["bytes_verified"] == (
                served // BLOCK_SIZE * RANK_BLOCK_BYTES
            )
        lookup_report(rig, record_property, "dead_redis")
    finally:
        rig.shutdown()


def test_another_model_sharing_the_disk_gets_none_of_its_blocks(
    pool: WorkerPool, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {"cpu_bytes": 6 * ROW_BYTES, "disk_dir": str(disk), "disk_bytes": "1MiB"}
    rig = TPRig.build(pool, tmp_path, extra, model_name="model-a")
    try:
        rig.add(PROMPT, req_id="first")
        rig.run()
    finally:
        rig.shutdown()
    other = TPRig.build(pool, tmp_path, extra, model_name="model-b")
    try:
        assert serve_again(other, "b") == 0
        assert other.manager.promotions_by_tier == {}
    finally:
        other.shutdown()
    same = TPRig.build(pool, tmp_path, extra, model_name="model-a")
    try:
        before = same.rank_stats()
        assert serve_again(same, "a-again") == len(PROMPT)  # a restart reads its own blocks
        assert_served_on_both_ranks(same, PROMPT_BLOCKS, before)
    finally:
        same.shutdown()
