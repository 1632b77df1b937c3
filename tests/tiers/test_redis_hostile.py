"""The Redis tier against a hostile server: refused stores (noeviction) and poisoned keys."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import redis

from kvoffload.tiers.redis.store import RedisBlockStore
from tests.conftest_redis import RedisServer, RedisServerFactory

BB = 4096
LOGGER = "kvoffload.transfer"


def keys_of(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") for i in range(n)]


def blocks_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)


def test_refused_stores_warn_once_with_the_count_and_recover(
    redis_server_factory: RedisServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory(maxmemory="3mb", maxmemory_policy="noeviction")
    s = RedisBlockStore(server.url, "oom", BB, geometry_fingerprint="g", hash_fn="x")
    data = blocks_of(8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        accepted = refused = 0
        for i in range(200):  # ~6 MB into a 3 MB server
            ok = s.put(keys_of(8, base=8 * i), data)
            accepted += sum(ok)
            refused += len(ok) - sum(ok)
        assert refused > 0 and accepted > 0
        starts = [r for r in caplog.records if "refuses stores" in r.getMessage()]
        assert len(starts) == 1, "refusals are announced once, not per store"
        assert s.stats.refused_stores == refused and s.stats.store_failures == refused
        client = raw(server)
        try:
            client.config_set("maxmemory", "0")  # room returns
        finally:
            client.close()
        assert s.put(keys_of(8, base=10_000), data) == [True] * 8
    back = [r.getMessage() for r in caplog.records if "accepts stores again" in r.getMessage()]
    assert back == [f"Redis tier at {server.url} accepts stores again ({refused} were refused "
                    "meanwhile)"]  # fmt: skip
    out = np.zeros_like(data)
    assert s.get_into(keys_of(8, base=10_000), out) == [True] * 8
    assert np.array_equal(out, data)
    s.close()


@pytest.mark.parametrize("poison", ["list", "hash", "set", "short_string"])
def test_poisoned_keys_are_detected_deleted_and_rewritten(
    redis_server: RedisServer, poison: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = RedisBlockStore(redis_server.url, "p", BB, geometry_fingerprint="g", hash_fn="x")
    keys, data = keys_of(6), blocks_of(6)
    client = raw(redis_server)
    try:
        for k in keys[:3]:
            rk = s.redis_key(k)
            if poison == "list":
                client.rpush(rk, b"x")
            elif poison == "hash":
                client.hset(rk, b"f", b"v")
            elif poison == "set":
                client.sadd(rk, b"m")
            else:
                client.set(rk, b"garbage")
        assert s.put(keys[3:], data[3:]) == [True] * 3
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            # A load meets them first (the engine believed they were there) ...
            assert s.get(keys)[:3] == [None] * 3
            # ... and a lookup no longer reports them, so the engine stores them again.
            assert s.contains_many(keys) == [False] * 3 + [True] * 3
        assert s.stats.poisoned_keys + s.stats.corrupt_values == 3
        assert "another type" in caplog.text or "failed verification" in caplog.text
        assert client.exists(*(s.redis_key(k) for k in keys[:3])) == 0
        assert s.put(keys[:3], data[:3]) == [True] * 3
        out = np.zeros_like(data)
        assert s.get_into(keys, out) == [True] * 6
        assert np.array_equal(out, data)
    finally:
        client.close()
        s.close()


def test_poisoned_keys_found_by_a_lookup_alone(redis_server: RedisServer) -> None:
    s = RedisBlockStore(redis_server.url, "p", BB, geometry_fingerprint="g", hash_fn="x")
    client = raw(redis_server)
    try:
        client.rpush(s.redis_key(keys_of(1)[0]), b"x")
        assert client.exists(s.redis_key(keys_of(1)[0])) == 1  # EXISTS would say "present"
        assert s.contains_many(keys_of(1)) == [False]
        assert s.stats.poisoned_keys == 1
        assert client.exists(s.redis_key(keys_of(1)[0])) == 0
    finally:
        client.close()
        s.close()


def test_poisoned_keys_under_a_ttl(redis_server: RedisServer) -> None:
    # GETEX (the TTL path) answers WRONGTYPE rather than nil.
    s = RedisBlockStore(redis_server.url, "p", BB, ttl_s=60, geometry_fingerprint="g", hash_fn="x")
    client = raw(redis_server)
    try:
        client.sadd(s.redis_key(keys_of(1)[0]), b"m")
        assert s.get(keys_of(1)) == [None]
        assert s.stats.poisoned_keys == 1
        assert s.put(keys_of(1), blocks_of(1)) == [True]
        assert s.get(keys_of(1))[0] is not None
    finally:
        client.close()
        s.close()
