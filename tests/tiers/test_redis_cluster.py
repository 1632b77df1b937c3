"""The remote tier on a real 3-master Redis Cluster on loopback (started by the fixture).

Skipped, with the reason, where ``redis-server`` or ``redis-cli`` is missing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import redis

from kvoffload.tiers.redis.store import RedisBlockStore
from kvoffload.tiers.redis.urls import (
    normalize_url,
    parse_cluster_url,
    redact_cluster_url,
    redact_url,
)
from tests.conftest_redis import (
    RedisClusterFactory,
    RedisClusterNodes,
    redis_cluster,
    redis_cluster_factory,
)
from tests.tiers.tier_rig import Rig, tkey

__all__ = ["redis_cluster", "redis_cluster_factory"]

BB = 4096


def keys_of(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") for i in range(n)]


def blocks_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def node_keys(cluster: RedisClusterNodes) -> list[int]:
    counts = []
    for n in cluster.nodes:
        c = redis.Redis(host="127.0.0.1", port=n.port, socket_timeout=2)
        try:
            counts.append(int(c.dbsize()))
        finally:
            c.close()
    return counts


# -- URLs (no server) --------------------------------------------------------------------


def test_cluster_urls_parse() -> None:
    u = parse_cluster_url("redis+cluster://alice:s%40cret@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert u.seeds == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)]
    assert (u.username, u.password, u.tls) == ("alice", "s@cret", False)
    assert parse_cluster_url("rediss+cluster://h:1/0").tls
    assert normalize_url("valkey+cluster://h:1") == "valkey+cluster://h:1"
    shown = redact_url("redis+cluster://u:topsecret@h:1,h:2")
    assert "topsecret" not in shown and shown == redact_cluster_url(
        "redis+cluster://u:topsecret@h:1,h:2"
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://h:1,,h:2",
        "redis+cluster://h:1/3",
        "redis+cluster://h:0",
        "redis+cluster://h:99999",
        "redis+cluster://h:1?x=1",
        "redis+cluster://:pw@:1",
    ],
)
def test_bad_cluster_urls_are_value_errors(url: str) -> None:
    with pytest.raises(ValueError, match="Redis"):
        RedisBlockStore(url, "ns", BB, check_connection=False)


def test_unreachable_cluster_starts_in_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest_redis import free_port

    s = RedisBlockStore(f"redis+cluster://127.0.0.1:{free_port()}", "ns", BB, timeout_s=0.2)
    try:
        assert "unreachable" in caplog.text
        assert not s.available
        assert s.put(keys_of(2), blocks_of(2)) == [False, False]
        assert s.get(keys_of(2)) == [None, None]
        assert s.contains_many(keys_of(2)) == [False, False]
    finally:
        s.close()


# -- a real cluster ----------------------------------------------------------------------


def test_round_trip_spreads_blocks_over_every_master(redis_cluster: RedisClusterNodes) -> None:
    s = RedisBlockStore(redis_cluster.url, "c", BB, geometry_fingerprint="g", hash_fn="x")
    try:
        keys, data = keys_of(60), blocks_of(60)
        assert s.put(keys, data) == [True] * 60
        assert all(n > 0 for n in node_keys(redis_cluster)), "blocks spread over the masters"
        assert s.contains_many(keys + keys_of(2, base=500)) == [True] * 60 + [False] * 2
        out = np.zeros_like(data)
        assert s.get_into(keys, out) == [True] * 60
        assert np.array_equal(out, data)
        # The hash tag: a block's key maps to the slot of its tag alone.
        from redis.crc import key_slot

        rk = s.redis_key(keys[0])
        tag = rk[rk.index(b"{") + 1 : rk.index(b"}")]
        assert key_slot(rk) == key_slot(tag)
        assert s.remove(keys[:10]) == 10
        assert s.clear() == 50
        assert sum(node_keys(redis_cluster)) == 0
    finally:
        s.close()


def test_a_master_killed_mid_run_costs_only_its_keys(redis_cluster: RedisClusterNodes) -> None:
    rig = Rig(cpu_blocks=1, redis_url=redis_cluster.url, redis_timeout_s=0.3)
    store = rig.tiers.redis_store
    assert store is not None and store.is_cluster
    store.retry_interval_s = 0  # every call probes: no clock in the test
    try:
        n = 30
        for i in range(n + 1):
            assert rig.store([i])  # 0..n-1 are written down to the cluster
        assert all(store.contains_many([tkey(i) for i in range(n)]))
        victim = redis_cluster.nodes[1]
        victim.kill()
        rig.clobber()
        hits = 0
        for i in range(n):
            got, ok = rig.load([i])  # the rig checks every loaded byte
            hits += got if ok else 0
        assert 0 < hits < n, "the surviving masters serve, the dead one's keys miss"
        for i in range(100, 110):  # stores go on; the dead node's share fails quietly
            assert rig.store([i])
        victim.start()  # back, empty, same cluster config: it rejoins
        redis_cluster.wait_state("ok")
        for i in range(200, 220):
            assert rig.store([i])
        rig.clobber()
        assert rig.load([205]) == (1, True)
    finally:
        rig.close()


def test_a_cluster_that_requires_full_coverage_goes_down_without_errors(
    redis_cluster_factory: RedisClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = redis_cluster_factory(full_coverage=True)
    s = RedisBlockStore(cluster.url, "c", BB, geometry_fingerprint="g", hash_fn="x")
    try:
        keys, data = keys_of(30), blocks_of(30)
        assert s.put(keys, data) == [True] * 30
        cluster.nodes[0].kill()
        cluster.wait_state("fail")  # the survivors now answer CLUSTERDOWN for every key
        with caplog.at_level(logging.WARNING, logger="kvoffload.transfer"):
            for _ in range(3):
                assert s.get(keys) == [None] * 30
                assert s.contains_many(keys) == [False] * 30
                assert s.put(keys_of(5, base=100), data[:5]) == [False] * 5
        assert len([r for r in caplog.records if "refuses stores" in r.getMessage()]) == 1
        cluster.nodes[0].start()
        cluster.wait_state("ok")
        with caplog.at_level(logging.WARNING, logger="kvoffload.transfer"):
            assert s.put(keys_of(5, base=200), data[:5]) == [True] * 5
        # The dead master's share failed as an outage; the survivors' share was refused.
        refused = s.stats.refused_stores
        assert 0 < refused <= 15
        assert f"accepts stores again ({refused} were refused meanwhile)" in caplog.text
    finally:
        s.close()


def test_two_instances_share_the_cluster(redis_cluster: RedisClusterNodes) -> None:
    a = Rig(cpu_blocks=1, redis_url=redis_cluster.url)
    b = Rig(cpu_blocks=1, redis_url=redis_cluster.url)
    try:
        for i in range(13):
            a.store([i])  # 0..11 written down
        b.truth = a.truth
        for i in range(12):
            assert b.load([i]) == (1, True)
        assert b.tiers.load_blocks_by_medium().get("REMOTE") == 12
        other = Rig(cpu_blocks=1, redis_url=redis_cluster.url, model_id="another-model")
        try:
            assert other.m.lookup([tkey(0)]) == 0  # another model never sees them
        finally:
            other.close()
    finally:
        a.close()
        b.close()


def test_engines_on_the_cluster_answer_identically_through_a_master_kill(
    tmp_path: Path, redis_cluster: RedisClusterNodes
) -> None:
    from kvoffload.engine.checkpoint import save_model
    from kvoffload.engine.config import EngineConfig
    from kvoffload.engine.llm_engine import LLMEngine
    from kvoffload.engine.model import build_model
    from kvoffload.engine.model_config import ModelConfig
    from kvoffload.engine.request import SamplingParams

    tiny = ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=1024,
    )
    ckpt = save_model(build_model(tiny, seed=5), tmp_path / "m")
    system = [(7 * i + 3) % 500 for i in range(32)]
    prompts = [system + [(11 * i + 37 * c + 1) % 500 for i in range(12)] for c in range(4)]
    sp = SamplingParams(max_tokens=3)
    cfg = {
        "model_path": str(ckpt),
        "block_size": 8,
        "num_gpu_blocks": 12,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 64,
        "num_cpu_blocks": 8,
        "write_through": True,  # every block reaches the cluster
    }

    def run(kill_after: int | None = None, **kw: object) -> tuple[list[list[int]], int]:
        with LLMEngine(EngineConfig(**cfg, **kw)) as engine:  # type: ignore[arg-type]
            outs = []
            for j, p in enumerate(prompts):
                if j == kill_after:
                    redis_cluster.nodes[2].kill()
                outs += engine.generate([p], sp)
            engine.drain()
            lower = (engine.tier_hit_breakdown() or {}).get("lower_hit_tokens", 0)
            return outs, lower

    ref, _ = run(store_mode="off")
    first, _ = run(redis_url=redis_cluster.url)  # fills the cluster
    assert first == ref
    second, lower = run(redis_url=redis_cluster.url, kill_after=2)
    assert second == ref
    assert lower > 0  # the second engine found the first one's blocks
