"""Faults of kvoffload's tiers inside vLLM's tiering: each ends in a miss, never a crash.

vLLM's real ``TieringOffloadingSpec`` and manager; the GPU<->CPU copies are
played in this process (both ranks' shards of each row). Every fault ends
with the block a miss (recomputed), never another block's or another
model's bytes, and no tier touches the network or the disk on the scheduler
thread (the store calls are recorded with their thread). Time spent in
lookups on the scheduler thread is printed per test.
"""

from __future__ import annotations

from tests.vllm_required import need_vllm

need_vllm()

import errno  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import redis  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, OffloadKey  # noqa: E402

from kvoffload.tiers.config import TierConfigError  # noqa: E402
from tests.conftest_redis import (  # noqa: E402, F401  (fixtures)
    RedisServer,
    redis_cluster,
    redis_cluster_factory,
)
from tests.full_disk import fill, tmpfs  # noqa: E402
from tests.integrations.vllm_tier_rig import (  # noqa: E402
    TierRig,
    disk_tier,
    keys_of,
    redis_tier,
)

N = 4


def report(rig: TierRig, what: str) -> None:
    per = rig.lookup_seconds / max(1, rig.lookup_calls)
    print(
        f"\n{what}: {rig.lookup_calls} lookups on the scheduler thread, "
        f"{rig.lookup_seconds * 1e3:.2f} ms in all ({per * 1e6:.1f} us each)"
    )


class ThreadLog:
    """Wraps a store's methods to record the thread each call runs on."""

    def __init__(self, store: Any, names: tuple[str, ...]) -> None:
        self.threads: list[tuple[str, int]] = []
        for name in names:
            real = getattr(store, name)

            def wrapped(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
                self.threads.append((_name, threading.get_ident()))
                return _real(*a, **k)

            setattr(store, name, wrapped)

    def names(self) -> set[str]:
        return {name for name, _ in self.threads}

    def on_main_thread(self) -> list[str]:
        main = threading.main_thread().ident
        return [name for name, t in self.threads if t == main]


def evict_from_cpu(rig: TierRig, tag: bytes, n: int = 16) -> None:
    rig.store_many(keys_of(n, tag=tag))
    rig.settle()


def in_lower_tier(rig: TierRig, tag: bytes) -> list[OffloadKey]:
    """``N`` keys offloaded (cascaded to the lower tiers), then pushed out of the CPU tier."""
    keys = keys_of(N, tag=tag)
    rig.store(keys)
    evict_from_cpu(rig, b"filler")
    return keys


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"dsk_bytes": "1GiB"}, "dsk_bytes"),
        ({"disk_bytes": "lots"}, "disk_bytes"),
        ({"write_mode": "write_back"}, "write_mode"),
        ({"redis_url": "redis://h:1"}, "redis_url"),
        ({"locality": "NEARBY"}, "locality"),
    ],
)
def test_a_bad_disk_key_is_one_line_at_start_up(
    tmp_path: Path, entry: dict[str, Any], named: str
) -> None:
    tier = {**disk_tier(tmp_path / "kv"), **entry}
    with pytest.raises(TierConfigError) as info:
        TierRig([tier])
    msg = str(info.value)
    assert "\n" not in msg and f"[{named!r}]" in msg and "KVOffloadDiskTier" in msg


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"redis_url": "http://h:1"}, "redis_url"),
        ({"redis_timeout_s": -1}, "redis_timeout_s"),
        ({"retry_interval_s": "soon"}, "retry_interval_s"),
        ({"disk_dir": "/x"}, "disk_dir"),
    ],
)
def test_a_bad_redis_key_is_one_line_at_start_up(entry: dict[str, Any], named: str) -> None:
    tier = {**redis_tier("redis://127.0.0.1:1/0"), **entry}
    with pytest.raises(TierConfigError) as info:
        TierRig([tier])
    msg = str(info.value)
    assert "\n" not in msg and f"[{named!r}]" in msg


# -- disk ----------------------------------------------------------------------------------


def test_a_corrupt_disk_block_is_a_failed_key_then_a_miss(tmp_path: Path) -> None:
    rig = TierRig([disk_tier(tmp_path / "kv")])
    try:
        (tier,) = rig.tiers
        log = ThreadLog(tier.store, ("put", "get_into"))
        keys = in_lower_tier(rig, b"corrupt")
        # Flip bytes of the third block in its slab (as a bad sector or a stray write would).
        slot = tier.manager.slot_of(keys[2])
        f, local = divmod(slot, tier.store.blocks_per_file)
        with open(Path(tier.directory) / f"slab-{f:05d}.bin", "r+b") as fh:
            fh.seek(local * tier.slot_bytes + 100)
            fh.write(b"\xff" * 64)
        hits, checks = rig.fetch(keys)
        # The first two blocks were promoted; the corrupt one failed its promotion and is
        # now a miss (the prefix stops there): never served.
        assert hits == 2 and all(all(c) for c in checks)
        assert rig.lookup(keys[2], rig.new_request()) is LookupResult.MISS
        stats = rig.stats()
        assert stats[f"vllm:kvoffload_tier_checksum_failures:('{tier.label}',)"] == 1
        assert stats[f"vllm:kv_offload_tiering_promotion_job_failures:('{tier.label}',)"] == 1
        assert log.on_main_thread() == []
        report(rig, "corrupt disk block")
    finally:
        rig.close()


def test_a_disk_block_evicted_between_lookup_and_load_is_a_failed_key(tmp_path: Path) -> None:
    rig = TierRig([disk_tier(tmp_path / "kv")])
    try:
        (tier,) = rig.tiers
        keys = in_lower_tier(rig, b"vanish")
        ctx = rig.new_request()
        assert [rig.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * N
        # Before the promotion is submitted (end of step), the tier loses the block.
        with rig.lock:
            tier.manager.drop([keys[1]])
        rig.settle()
        results = [rig.lookup(k, ctx) for k in keys]
        assert results[1] is LookupResult.MISS
        assert results[0] is LookupResult.HIT and results[2] is LookupResult.HIT
        rig.finish(ctx)
        assert rig.stats()[f"vllm:kvoffload_tier_blocks_lost:('{tier.label}',)"] == 1
    finally:
        rig.close()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "mnt", "3m") as mnt:
        yield mnt


def test_a_full_disk_warns_once_and_never_serves_a_bad_block(
    tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = TierRig([disk_tier(tiny_tmpfs, "2MiB")])
    try:
        fill(tiny_tmpfs)
        caplog.set_level(logging.WARNING)
        keys = keys_of(12, tag=b"full")
        rig.store_many(keys)
        evict_from_cpu(rig, b"filler")
        warnings = [r for r in caplog.records if "filesystem is full" in r.getMessage()]
        assert len(warnings) == 1
        # The slabs were allocated at start-up: blocks still land and are read back whole;
        # only their index records (the restart's memory) were refused.
        hits, checks = rig.fetch(keys[:N])
        assert hits == N and all(all(c) for c in checks)
        report(rig, "full disk")
    finally:
        rig.close()


def test_failing_slab_writes_are_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = TierRig([disk_tier(tmp_path / "kv")])
    try:
        (tier,) = rig.tiers
        real = os.pwritev

        def enospc(fd: int, bufs: Any, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", enospc)
        keys = keys_of(N, tag=b"nospace")
        rig.store(keys)
        rig.settle()
        monkeypatch.setattr(os, "pwritev", real)
        evict_from_cpu(rig, b"filler")
        hits, _ = rig.fetch(keys)
        assert hits == 0
        assert rig.stats()[f"vllm:kvoffload_tier_write_errors:('{tier.label}',)"] == N
    finally:
        rig.close()


def test_another_revision_sharing_the_directory_sees_no_block(tmp_path: Path) -> None:
    keys = keys_of(N, tag=b"rev")
    rig = TierRig([disk_tier(tmp_path / "kv", model_revision="rev-a")])
    try:
        rig.store(keys)
        rig.settle()
    finally:
        rig.close()
    other = TierRig([disk_tier(tmp_path / "kv", model_revision="rev-b")])
    try:
        assert other.fetch(keys)[0] == 0
        report(other, "another revision, disk")
    finally:
        other.close()
    again = TierRig([disk_tier(tmp_path / "kv", model_revision="rev-a")])
    try:
        # The same identity after a restart: the blocks survived, and are whole.
        hits, checks = again.fetch(keys)
        assert hits == N and all(all(c) for c in checks)
    finally:
        again.close()
    assert len(list((tmp_path / "kv").iterdir())) == 2


def test_parallel_agnostic_layouts_share_blocks_across_tp_sizes(tmp_path: Path) -> None:
    keys = keys_of(N, tag=b"agnostic")
    tp2 = TierRig([disk_tier(tmp_path / "kv")], world_size=2, worker_block_bytes=32 << 10)
    try:
        tp2.store(keys)
        tp2.settle()
    finally:
        tp2.close()
    # Not certified: another TP size is another identity.
    tp1 = TierRig([disk_tier(tmp_path / "kv")], world_size=1, worker_block_bytes=64 << 10)
    try:
        assert tp1.fetch(keys)[0] == 0
    finally:
        tp1.close()
    # Certified parallel-agnostic: TP=2's rows serve TP=1 (same bytes under any layout).
    tp2_agnostic = TierRig(
        [disk_tier(tmp_path / "kv")], world_size=2, worker_block_bytes=32 << 10, agnostic=True
    )
    try:
        tp2_agnostic.store(keys)
        tp2_agnostic.settle()
    finally:
        tp2_agnostic.close()
    tp1 = TierRig(
        [disk_tier(tmp_path / "kv")], world_size=1, worker_block_bytes=64 << 10, agnostic=True
    )
    try:
        assert tp1.fetch(keys)[0] == N
    finally:
        tp1.close()


# -- Redis ---------------------------------------------------------------------------------


def test_a_redis_block_deleted_between_lookup_and_load_is_a_failed_key(
    redis_server: RedisServer,
) -> None:
    rig = TierRig([redis_tier(redis_server.url)])
    try:
        (tier,) = rig.tiers
        keys = in_lower_tier(rig, b"lru")
        ctx = rig.new_request()
        assert rig.prefix_lookup(keys, ctx) is None  # RETRY: presence asked off-thread
        rig.step()
        rig.settle()
        # What maxmemory + allkeys-lru does between the presence check and the load.
        client = redis.Redis.from_url(redis_server.url)
        assert client.delete(tier.store.redis_key(keys[1])) == 1
        results = [rig.lookup(k, ctx) for k in keys]
        assert results == [LookupResult.HIT_PENDING] * N
        rig.settle()
        results = [rig.lookup(k, ctx) for k in keys]
        assert results[1] is LookupResult.MISS
        assert results[0] is LookupResult.HIT and results[2] is LookupResult.HIT
        rig.finish(ctx)
        stats = rig.stats()
        assert stats[f"vllm:kvoffload_tier_blocks_lost:('{tier.label}',)"] == 1
        report(rig, "Redis block evicted between lookup and load")
    finally:
        rig.close()


def test_a_corrupt_redis_value_is_never_served(redis_server: RedisServer) -> None:
    rig = TierRig([redis_tier(redis_server.url)])
    try:
        (tier,) = rig.tiers
        keys = in_lower_tier(rig, b"rcorrupt")
        client = redis.Redis.from_url(redis_server.url)
        rkey = tier.store.redis_key(keys[0])
        value = bytearray(client.get(rkey))
        value[-10:] = b"x" * 10
        client.set(rkey, bytes(value))
        assert rig.fetch(keys)[0] == 0
        assert rig.stats()[f"vllm:kvoffload_tier_checksum_failures:('{tier.label}',)"] == 1
    finally:
        rig.close()


def test_a_dead_redis_is_misses_dropped_stores_one_warning_then_recovery(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    rig = TierRig([redis_tier(redis_server.url, retry_interval_s=0.05, max_retry_interval_s=0.05)])
    try:
        (tier,) = rig.tiers
        log = ThreadLog(tier.store, ("put", "get_into", "contains_many"))
        tier.checks._exists = tier.store.contains_many
        keys = keys_of(N, tag=b"dead")
        rig.store(keys)
        rig.settle()
        caplog.set_level(logging.WARNING)
        redis_server.kill()
        evict_from_cpu(rig, b"filler")
        assert rig.fetch(keys)[0] == 0
        more = keys_of(N, tag=b"while-dead")
        rig.store(more)
        rig.settle()
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 1
        assert rig.fetch(keys)[0] == 0
        stats = rig.stats()
        assert stats[f"vllm:kvoffload_tier_stores_dropped:('{tier.label}',)"] >= N
        assert stats[f"vllm:kvoffload_tier_available:('{tier.label}',)"] == 0
        redis_server.start()  # empty: nothing was persisted
        # Health probes run off-thread while down; stores resume once the breaker closes.
        for _ in range(400):
            rig.step()
            if tier.store.available:
                break
            threading.Event().wait(0.01)
        assert tier.store.available
        rig.store(keys)
        evict_from_cpu(rig, b"filler-2")
        assert rig.fetch(keys)[0] == N
        assert log.names() == {"put", "get_into", "contains_many"}
        assert log.on_main_thread() == []
        report(rig, "dead Redis")
    finally:
        rig.close()
    assert rig.unmapped


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
                held.append(conn)
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        sock.close()


def test_a_silent_redis_at_start_up_is_an_outage_not_an_error(
    silent_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rig = TierRig([redis_tier(silent_server, redis_timeout_s=0.2)])
    try:
        (tier,) = rig.tiers
        log = ThreadLog(tier.store, ("put", "get_into", "contains_many"))
        tier.checks._exists = tier.store.contains_many
        keys = in_lower_tier(rig, b"silent")
        assert rig.fetch(keys)[0] == 0
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
        assert log.on_main_thread() == []
        report(rig, "silent Redis")
    finally:
        rig.close()
    assert rig.unmapped


def test_another_revision_sharing_the_namespace_sees_no_block(redis_server: RedisServer) -> None:
    keys = keys_of(N, tag=b"rrev")
    rig = TierRig([redis_tier(redis_server.url, model_revision="rev-a")])
    try:
        rig.store(keys)
        rig.settle()
    finally:
        rig.close()
    other = TierRig([redis_tier(redis_server.url, model_revision="rev-b")])
    try:
        assert other.fetch(keys)[0] == 0
    finally:
        other.close()
    again = TierRig([redis_tier(redis_server.url, model_revision="rev-a")])
    try:
        hits, checks = again.fetch(keys)
        assert hits == N and all(all(c) for c in checks)
    finally:
        again.close()


def test_a_redis_evicting_under_maxmemory_is_misses_never_errors(
    redis_server_factory: Any,
) -> None:
    server = redis_server_factory(maxmemory="2mb", maxmemory_policy="allkeys-lru")
    rig = TierRig([redis_tier(server.url)])
    try:
        keys = keys_of(64, tag=b"maxmem")  # 4 MiB of rows into a 2 MiB server
        rig.store_many(keys)
        rig.settle()
        evict_from_cpu(rig, b"filler")
        hits, checks = rig.fetch(keys)
        assert hits < len(keys) and all(all(c) for c in checks)
        hits, checks = rig.fetch(keys[-4:])
        assert all(all(c) for c in checks)
    finally:
        rig.close()


def test_a_redis_cluster_seed_list_serves_blocks(redis_cluster: Any) -> None:  # noqa: F811
    rig = TierRig([redis_tier(redis_cluster.url)])
    try:
        (tier,) = rig.tiers
        assert tier.store.is_cluster
        keys = in_lower_tier(rig, b"cluster")
        hits, checks = rig.fetch(keys)
        assert hits == N and all(all(c) for c in checks)
        assert tier.checks.batches == 1
    finally:
        rig.close()


def test_kvoffload_metrics_are_declared_to_vllms_spec(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvoffload.integrations.vllm.tiers.metrics import metric_definitions

    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [disk_tier(tmp_path / "kv"), redis_tier("redis://127.0.0.1:1/0")],
    }
    defs = TieringOffloadingSpec.build_metric_definitions(extra)
    ours = metric_definitions()
    assert ours and all(defs[name] == meta for name, meta in ours.items())
    assert all(meta.labelnames == ("tier",) for meta in ours.values())


def test_vllms_reset_cache_drains_the_tiers_and_keeps_their_blocks(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    rig = TierRig([disk_tier(tmp_path / "kv"), redis_tier(redis_server.url)])
    try:
        keys = keys_of(N, tag=b"reset")
        ctx = rig.new_request()
        rig.store(keys, ctx)  # cascades in flight
        with rig.lock:
            rig.manager.reset_cache()
            rig.manager.on_reset_flushed()
        rig.finish(ctx)
        rig.settle()
        # Secondary tiers are persistent across vLLM's resets (its tiering's contract).
        hits, checks = rig.fetch(keys)
        assert hits == N and all(all(c) for c in checks)
    finally:
        rig.close()


def test_vllms_backpressure_detector_reads_the_tiers_store_latencies(tmp_path: Path) -> None:
    bp = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy"}
    rig = TierRig([disk_tier(tmp_path / "kv", backpressure=bp)])
    try:
        (tier,) = rig.tiers
        assert tier.bp_detector is not None
        rig.store_many(keys_of(24, tag=b"bp"), batch=1)  # past the detector's warm-up
        rig.settle()
        ema = rig.stats()[
            f"vllm:kv_offload_tiering_backpressure_store_latency_ema:('{tier.label}',)"
        ]
        assert ema > 0
    finally:
        rig.close()
