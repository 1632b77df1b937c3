"""kvoffload's disk and Redis tiers inside vLLM 0.33's own tiering, with two TP ranks.

vLLM's real ``TieringOffloadingSpec(...).get_manager()`` runs here (the
scheduler side) with ``KVOffloadDiskTier`` / ``KVOffloadRedisTier`` named
by their public ``type`` / ``module_path``; two spawned worker processes
(TP=2) map vLLM's ``SharedOffloadRegion`` for their rank and write / read
their shard of each chunk as the GPU<->CPU copies would. A prefix stored,
then evicted from the CPU tier by later blocks, is looked up as vLLM's
connector does (RETRY / HIT_PENDING until promoted) and loaded: each rank
reads back exactly what it wrote, first from disk, then from Redis.
"""

from __future__ import annotations

from tests.vllm_required import need_vllm

need_vllm()

import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadDiskTier, KVOffloadRedisTier  # noqa: E402
from tests.conftest_redis import RedisServer  # noqa: E402
from tests.integrations.vllm_tier_rig import (  # noqa: E402
    Ranks,
    TierRig,
    disk_tier,
    keys_of,
    redis_tier,
)

PREFIX = 6
FILLER = 24


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    r = Ranks(world_size=2)
    try:
        yield r
    finally:
        r.close()


def evict_from_cpu(rig: TierRig, n: int = FILLER, tag: bytes = b"filler") -> None:
    rig.store_many(keys_of(n, tag=tag))
    rig.settle()


def all_equal(checks: list[list[bool]], n: int) -> bool:
    return len(checks) == 2 and all(len(c) == n and all(c) for c in checks)


def report(rig: TierRig, what: str) -> None:
    per = rig.lookup_seconds / max(1, rig.lookup_calls)
    print(
        f"\n{what}: {rig.lookup_calls} lookups on the scheduler thread, "
        f"{rig.lookup_seconds * 1e3:.2f} ms in all ({per * 1e6:.1f} us each), {rig.steps} steps"
    )


def test_prefix_evicted_from_cpu_is_served_from_disk_on_both_ranks(
    tmp_path: Path, ranks: Ranks
) -> None:
    rig = TierRig([disk_tier(tmp_path / "kv", "4MiB")], ranks=ranks)
    try:
        (tier,) = rig.tiers
        assert isinstance(tier, KVOffloadDiskTier)
        prefix = keys_of(PREFIX, tag=b"prompt")
        rig.store_many(prefix)
        evict_from_cpu(rig)
        probe = ReqContext("probe")
        with rig.lock:
            assert all(
                rig.manager.primary_tier.lookup(k, probe) is LookupResult.MISS for k in prefix
            )
        hits, checks = rig.fetch(prefix)
        assert hits == PREFIX
        assert all_equal(checks, PREFIX)
        stats = rig.stats()
        label = tier.label
        assert label == "1:KVOffloadDiskTier"
        assert stats[f"vllm:kv_offload_tiering_read_bytes:('{label}',)"] == PREFIX * rig.row_bytes
        assert stats[f"vllm:kv_offload_tiering_write_bytes:('{label}',)"] >= (
            (PREFIX + FILLER) * rig.row_bytes
        )
        assert f"vllm:kv_offload_tiering_read_time:('{label}',)" in stats
        assert stats[f"vllm:kvoffload_tier_bytes_in_use:('{label}',)"] == (
            (PREFIX + FILLER) * rig.row_bytes
        )
        stored = [e for e in rig.events if e.medium is Medium.STORAGE and not e.removed]
        assert stored and all(e.locality is Locality.LOCAL for e in stored)
        report(rig, "disk, TP=2")
    finally:
        rig.close()


def test_disk_budget_holds_and_evictions_are_announced(tmp_path: Path, ranks: Ranks) -> None:
    # A row is both ranks' shards (2 x 32 KiB): 2 MiB holds 32 rows; 48 are written.
    rig = TierRig([disk_tier(tmp_path / "kv", "2MiB")], ranks=ranks)
    try:
        (tier,) = rig.tiers
        capacity = tier.capacity_blocks
        assert capacity == (2 << 20) // rig.row_bytes
        keys = keys_of(capacity + 16, tag=b"many")
        rig.store_many(keys)
        rig.settle()
        assert tier.manager.num_stored_blocks() == capacity
        removed = [
            k for e in rig.events if e.removed and e.medium is Medium.STORAGE for k in e.keys
        ]
        assert len(removed) == 16 and set(removed) == set(keys[:16])
        slabs = sum(p.stat().st_size for p in Path(tier.directory).glob("slab-*.bin"))
        assert slabs == capacity * tier.slot_bytes
        # The newest blocks are still served, on both ranks.
        hits, checks = rig.fetch(keys[-4:])
        assert hits == 4 and all_equal(checks, 4)
        assert rig.stats()[f"vllm:kvoffload_tier_evictions:('{tier.label}',)"] == 16
    finally:
        rig.close()


def test_data_parallel_replicas_share_a_disk_dir_and_split_its_budget(tmp_path: Path) -> None:
    """Each replica's scheduler owns half of ``disk_bytes`` in a store of its own; both
    start on one ``disk_dir`` (one store is one process's) and each serves its blocks."""
    rigs = [TierRig([disk_tier(tmp_path / "kv", "2MiB")], data_parallel=(i, 2)) for i in range(2)]
    try:
        tiers = [rig.tiers[0] for rig in rigs]
        assert [t.capacity_blocks for t in tiers] == [(1 << 20) // rigs[0].row_bytes] * 2
        assert len({t.directory for t in tiers}) == 2
        for i, rig in enumerate(rigs):
            prefix = keys_of(PREFIX, tag=b"replica%d" % i)
            rig.store_many(prefix)
            evict_from_cpu(rig, n=9)  # past the 8-row CPU tier, within the 16-row disk share
            hits, _ = rig.fetch(prefix)
            assert hits == PREFIX
        slabs = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("slab-*.bin"))
        assert slabs <= 2 << 20
    finally:
        for rig in rigs:
            rig.close()


def _disk_io_threads() -> int:
    return sum(t.name.startswith("kvoffload-KVOffloadDiskTier-io") for t in threading.enumerate())


@pytest.mark.parametrize(
    ("disk_bytes", "replicas", "why"),
    [("96KiB", 4, "data-parallel replicas"), ("4KiB", 1, "smaller than one block")],
)
def test_a_budget_too_small_is_one_line_and_leaves_no_thread(
    tmp_path: Path, disk_bytes: str, replicas: int, why: str
) -> None:
    from kvoffload.tiers.config import TierConfigError

    before = _disk_io_threads()
    with pytest.raises(TierConfigError, match=why) as info:
        TierRig([disk_tier(tmp_path / "kv", disk_bytes)], data_parallel=(0, replicas))
    assert "\n" not in str(info.value)
    assert _disk_io_threads() == before


def test_prefix_is_served_from_redis_on_both_ranks(redis_server: RedisServer, ranks: Ranks) -> None:
    rig = TierRig([redis_tier(redis_server.url)], ranks=ranks)
    try:
        (tier,) = rig.tiers
        assert isinstance(tier, KVOffloadRedisTier)
        prefix = keys_of(PREFIX, tag=b"prompt-redis")
        rig.store_many(prefix)
        evict_from_cpu(rig, tag=b"filler-redis")
        hits, checks = rig.fetch(prefix)
        assert hits == PREFIX
        assert all_equal(checks, PREFIX)
        # Presence of the whole prefix was asked in one pipelined batch.
        assert tier.checks.batches == 1 and tier.checks.keys_checked == PREFIX
        stats = rig.stats()
        assert stats[f"vllm:kv_offload_tiering_read_bytes:('{tier.label}',)"] == (
            PREFIX * rig.row_bytes
        )
        stored = [e for e in rig.events if e.medium is Medium.STORAGE and not e.removed]
        assert stored and all(e.locality is Locality.REMOTE for e in stored)
        report(rig, "Redis, TP=2")
    finally:
        rig.close()


def test_disk_then_redis_in_one_stack(
    tmp_path: Path, redis_server: RedisServer, ranks: Ranks
) -> None:
    """Both tiers under one manager; the disk directory removed: Redis serves the prefix."""
    tiers = [disk_tier(tmp_path / "kv", "4MiB"), redis_tier(redis_server.url)]
    rig = TierRig(tiers, ranks=ranks)
    prefix = keys_of(PREFIX, tag=b"stack")
    try:
        rig.store_many(prefix)
        evict_from_cpu(rig, tag=b"filler-stack")
        hits, checks = rig.fetch(prefix)
        assert hits == PREFIX and all_equal(checks, PREFIX)
        disk, redis_t = rig.tiers
        assert rig.stats()[f"vllm:kv_offload_tiering_read_bytes:('{disk.label}',)"] > 0
        assert redis_t.label == "2:KVOffloadRedisTier"
    finally:
        rig.close()
    # A second engine with the Redis tier only (no disk tier): the prefix comes from Redis.
    rig = TierRig([redis_tier(redis_server.url)], ranks=ranks)
    try:
        hits, checks = rig.fetch(prefix)
        assert hits == PREFIX and all_equal(checks, PREFIX)
        report(rig, "Redis after the disk tier was removed, TP=2")
    finally:
        rig.close()
