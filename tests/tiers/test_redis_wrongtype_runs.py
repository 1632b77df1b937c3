"""Garbage of other Redis types under the namespace costs one miss per key, once.

Engines serve a workload through a real Redis tier; then every block key is
overwritten with a value of another type (list, hash, set, sorted set,
stream, HyperLogLog string). A WRONGTYPE answer drops the key as a corrupt
value is dropped: a fresh engine meets each poisoned key as a miss (never a
failed load) and the key is gone for the next run; an engine that still
believed the keys present fails at most one load per poisoned key, once.
"""

from __future__ import annotations

import redis

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams
from kvoffload.tiers.redis.store import RedisBlockStore
from tests.conftest_redis import RedisServer

BS = 8
PROMPTS = [[(7 * i + 13 * c) % 400 + 1 for i in range(8 * BS + 3)] for c in range(6)]


def _engine(url: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            block_size=BS,
            num_gpu_blocks=20,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            num_cpu_blocks=4,
            redis_url=url,
            write_through=True,
        )
    )


def _serve(engine: LLMEngine) -> tuple[int, int]:
    """(loads that succeeded, loads that failed) while serving ``PROMPTS`` once."""
    assert engine.connector is not None
    stats = engine.connector.stats
    ok, failed = stats.loads_ok, stats.loads_failed
    engine.generate(PROMPTS, SamplingParams(max_tokens=2))
    engine.drain()
    return stats.loads_ok - ok, stats.loads_failed - failed


def _redis_store(engine: LLMEngine) -> RedisBlockStore:
    assert engine.offload is not None
    (tiers,) = engine.offload.closers
    store = tiers.redis_store  # type: ignore[attr-defined]
    assert store is not None
    return store


def _poison(server: RedisServer) -> int:
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)
    keys = list(client.scan_iter(match=b"kvo:*"))
    writers = [
        lambda k: client.rpush(k, b"x"),
        lambda k: client.hset(k, "a", "b"),
        lambda k: client.sadd(k, "a"),
        lambda k: client.zadd(k, {"a": 1}),
        lambda k: client.xadd(k, {"a": "b"}),
        lambda k: client.pfadd(k, "a"),
    ]
    for i, k in enumerate(keys):
        client.delete(k)
        writers[i % len(writers)](k)
    client.close()
    return len(keys)


def test_a_fresh_engine_meets_poisoned_keys_as_misses_once(redis_server: RedisServer) -> None:
    first = _engine(redis_server.url)
    try:
        _serve(first)
    finally:
        first.close()
    assert _poison(redis_server) > 0
    for run in range(2):
        engine = _engine(redis_server.url)
        try:
            ok, failed = _serve(engine)
            store = _redis_store(engine)
            dropped = store.stats.poisoned_keys + store.stats.corrupt_values
        finally:
            engine.close()
        assert failed == 0, f"run {run}: a poisoned key failed a load"
        if run == 0:
            assert dropped > 0
        else:
            assert dropped == 0, "a poisoned key survived the run that met it"
            assert ok > 0  # the blocks were stored again and serve hits


def test_an_engine_that_knew_the_keys_fails_each_load_once(redis_server: RedisServer) -> None:
    engine = _engine(redis_server.url)
    try:
        _serve(engine)
        _, failed = _serve(engine)
        assert failed == 0
        poisoned = _poison(redis_server)
        total = 0
        for _ in range(3):
            _, failed = _serve(engine)
            total += failed
        assert total <= poisoned
        assert _serve(engine)[1] == 0
    finally:
        engine.close()
