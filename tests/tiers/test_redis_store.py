"""RedisBlockStore against a real redis-server: round trips, faults, sharing, bounded memory."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import redis

from kvoffload.tiers.redis.store import (
    HEADER_BYTES,
    RedisBlockStore,
    RedisStoreError,
    namespace_prefix,
    normalize_url,
    redact_url,
)
from tests.conftest_redis import RedisServer, RedisServerFactory, free_port

pytestmark = pytest.mark.redis

GEOM = "layers=2,kv_heads=2,head=8,block=4,dtype=float16"
BB = 4096


def keys_of(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]


def blocks_of(n: int, block_bytes: int = BB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def make_store(url: str, **kw: object) -> RedisBlockStore:
    kw.setdefault("geometry_fingerprint", GEOM)
    kw.setdefault("hash_fn", "xxhash64")
    kw.setdefault("timeout_s", 0.5)
    bb = int(kw.pop("block_bytes", BB))  # type: ignore[call-overload]
    ns = str(kw.pop("namespace", "test"))
    return RedisBlockStore(url, ns, bb, **kw)  # type: ignore[arg-type]


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)


def wait_until(cond: object, what: str, limit: int = 500) -> None:
    for _ in range(limit):
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- round trips --------------------------------------------------------------


@pytest.mark.parametrize("block_bytes", [1, 4096, 100_000])
def test_round_trip_bit_identical(redis_server: RedisServer, block_bytes: int) -> None:
    with make_store(redis_server.url, block_bytes=block_bytes, max_batch_bytes=300_000) as s:
        data = blocks_of(12, block_bytes)
        assert s.put(keys_of(12), data) == [True] * 12
        out = np.zeros_like(data)
        assert s.get_into(keys_of(12), out) == [True] * 12
        assert np.array_equal(out, data)
        assert s.contains_many(keys_of(13)) == [True] * 12 + [False]


def test_miss_leaves_buffer_untouched(redis_server: RedisServer) -> None:
    with make_store(redis_server.url) as s:
        s.put(keys_of(1), blocks_of(1))
        out = np.full((2, BB), 7, dtype=np.uint8)
        assert s.get_into(keys_of(2), out) == [True, False]
        assert (out[1] == 7).all()


def test_ttl_expires_blocks(redis_server: RedisServer) -> None:
    with make_store(redis_server.url, ttl_s=60) as s:
        s.put(keys_of(1), blocks_of(1))
        ttl = raw_client(redis_server).pttl(s.redis_key(keys_of(1)[0]))
        assert 0 < ttl <= 60_000
        assert s.get(keys_of(1))[0] is not None  # a hit refreshes it (GETEX)


def test_remove_and_clear(redis_server: RedisServer) -> None:
    with make_store(redis_server.url) as s, make_store(redis_server.url, namespace="other") as o:
        s.put(keys_of(5), blocks_of(5))
        o.put(keys_of(5), blocks_of(5))
        assert s.remove(keys_of(2)) == 2
        assert s.clear() == 3
        assert s.contains_many(keys_of(5)) == [False] * 5
        assert o.contains_many(keys_of(5)) == [True] * 5  # other namespaces untouched


# -- namespaces: incompatible engines never share ------------------------------


def test_incompatible_engines_never_read_each_other(redis_server: RedisServer) -> None:
    url = redis_server.url
    base = make_store(url)
    base.put(keys_of(3), blocks_of(3))
    same = make_store(url)
    assert same.contains_many(keys_of(3)) == [True] * 3
    for other in (
        make_store(url, geometry_fingerprint=GEOM + ",other"),
        make_store(url, hash_fn="sha256_cbor"),
        make_store(url, namespace="prod"),
        make_store(url, block_bytes=BB * 2),
    ):
        assert other.contains_many(keys_of(3)) == [False] * 3
        assert other.get(keys_of(3)) == [None] * 3


def test_prefix_depends_on_everything() -> None:
    p = namespace_prefix("ns", 4096, "g", "xxhash64")
    assert p.startswith(b"kvo:ns:")
    assert p != namespace_prefix("ns", 4096, "g", "sha256_cbor")
    assert p != namespace_prefix("ns", 4096, "h", "xxhash64")
    assert p != namespace_prefix("ns", 8192, "g", "xxhash64")
    with pytest.raises(ValueError, match="namespace"):
        namespace_prefix("", 1, "g", "x")


# -- verification on read -------------------------------------------------------


def test_corrupt_truncated_and_foreign_values_are_misses(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    raw = raw_client(redis_server)
    with make_store(redis_server.url) as s:
        data = blocks_of(5)
        s.put(keys_of(5), data)
        k = [s.redis_key(x) for x in keys_of(5)]
        v = bytearray(raw.get(k[0]))
        v[HEADER_BYTES + 10] ^= 1
        raw.set(k[0], bytes(v))  # one bit flipped
        raw.set(k[1], raw.get(k[1])[:-1])  # truncated
        raw.set(k[2], b"hello")  # foreign
        raw.set(k[3], raw.get(k[4]))  # another block's value under this key
        out = np.zeros_like(data)
        with caplog.at_level(logging.WARNING):
            assert s.get_into(keys_of(5), out) == [False, False, False, False, True]
        assert "failed verification" in caplog.text
        assert s.stats.corrupt_values == 4
        assert np.array_equal(out[4], data[4])
        assert raw.exists(*k[:4]) == 0  # dropped


# -- bad configuration --------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "empty"),
        ("http://localhost:6379", "scheme"),
        ("localhost:6379", "scheme"),
        ("redis://localhost:notaport", "bad Redis URL"),
        ("redis://localhost:99999", "bad Redis URL"),
        ("redis://:6379/0", "no host"),
        ("redis://localhost:6379/abc", "database number"),
        ("unix://", "socket path"),
    ],
)
def test_bad_urls_are_clear_errors(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RedisBlockStore(url, "ns", BB, check_connection=False)


def test_urls_accepted() -> None:
    assert normalize_url("valkey://h:1/2") == "redis://h:1/2"
    assert normalize_url("rediss://h") == "rediss://h"
    assert normalize_url("unix:///tmp/redis.sock") == "unix:///tmp/redis.sock"
    assert redact_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"


def test_bad_password_in_url_is_not_printed() -> None:
    with pytest.raises(ValueError) as e:
        RedisBlockStore("http://u:topsecret@h:1", "ns", BB, check_connection=False)
    assert "topsecret" not in str(e.value)


def test_bad_arguments() -> None:
    for kw in ({"ttl_s": 0}, {"timeout_s": 0}, {"retry_interval_s": -1}):
        with pytest.raises(ValueError):
            RedisBlockStore("redis://h:1", "ns", BB, check_connection=False, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_bytes"):
        RedisBlockStore("redis://h:1", "ns", 0, check_connection=False)
    with pytest.raises(ValueError, match="namespace"):
        RedisBlockStore("redis://h:1", "", BB, check_connection=False)


def test_rejected_credentials_are_a_clear_error(
    redis_server_factory: RedisServerFactory,
) -> None:
    server = redis_server_factory()
    raw_client(server).config_set("requirepass", "right")
    with pytest.raises(RedisStoreError, match="credentials"):
        make_store(f"redis://:wrong@127.0.0.1:{server.port}/0")
    with pytest.raises(RedisStoreError, match="credentials"):
        make_store(server.url)  # none given
    with make_store(f"redis://:right@127.0.0.1:{server.port}/0") as s:
        assert s.put(keys_of(1), blocks_of(1)) == [True]


# -- dead server: misses and failed stores, one warning, recovery --------------


def test_unreachable_server_at_start_up_warns_and_misses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING):
        s = make_store(url)
    assert not s.available
    assert "unreachable" in caplog.text
    assert s.put(keys_of(2), blocks_of(2)) == [False, False]
    assert s.get(keys_of(2)) == [None, None]
    assert s.contains_many(keys_of(2)) == [False, False]
    s.close()


def test_server_killed_mid_run_and_restarted(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # retry_interval_s=0: every call probes, so the test needs no clock.
    s = make_store(redis_server.url, retry_interval_s=0, timeout_s=0.3)
    data = blocks_of(8)
    assert all(s.put(keys_of(8), data))
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers.redis.store"):
        for _ in range(20):
            assert s.get(keys_of(8)) == [None] * 8
            assert s.put(keys_of(4, base=50), data[:4]) == [False] * 4
            assert s.contains_many(keys_of(8)) == [False] * 8
            assert s.remove(keys_of(1)) == 0
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, "the outage is logged once, not per call"
    assert not s.available and s.stats.outages == 1
    redis_server.start()  # same port, empty
    # The return is noticed by the next call or by the prober, whichever is first.
    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers.redis.store"):
        assert s.put(keys_of(8), data) == [True] * 8
    assert s.available
    assert caplog.text.count("is back after") == 1
    out = np.zeros_like(data)
    assert s.get_into(keys_of(8), out) == [True] * 8
    assert np.array_equal(out, data)
    s.close()


def test_breaker_skips_the_network_during_an_outage(redis_server: RedisServer) -> None:
    s = make_store(redis_server.url, retry_interval_s=3600)
    redis_server.kill()
    assert s.get(keys_of(1)) == [None]  # this call finds the outage
    for _ in range(5):
        assert s.get(keys_of(1)) == [None]
    assert s.stats.calls_skipped == 5
    redis_server.start()
    assert s.get(keys_of(1)) == [None]  # still assumed down: no probe before the interval
    assert s.ping()  # an explicit probe ends the outage
    assert s.available
    assert s.put(keys_of(1), blocks_of(1)) == [True]
    s.close()


def test_recovery_with_the_interval(redis_server: RedisServer) -> None:
    s = make_store(redis_server.url, retry_interval_s=0.05)
    redis_server.restart()  # pooled connections go stale
    # The single immediate retry reconnects: no outage at all.
    assert s.put(keys_of(1), blocks_of(1)) == [True]
    redis_server.kill()
    assert s.put(keys_of(1), blocks_of(1)) == [False]
    redis_server.start()
    wait_until(lambda: s.put(keys_of(1), blocks_of(1)) == [True], "recovery")
    assert s.available
    s.close()


def test_blackholed_server_is_bounded_by_the_timeout() -> None:
    """A server that accepts but never answers: calls give up after timeout_s."""
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    port = lsock.getsockname()[1]
    try:
        s = make_store(f"redis://127.0.0.1:{port}/0", timeout_s=0.05, check_connection=False)
        assert s.get(keys_of(1)) == [None]
        assert s.put(keys_of(1), blocks_of(1)) == [False]
        assert not s.available
        s.close()
    finally:
        lsock.close()


# -- bounded memory -------------------------------------------------------------


def test_bounded_memory_with_server_eviction(redis_server_factory: RedisServerFactory) -> None:
    server = redis_server_factory(maxmemory="3mb", maxmemory_policy="allkeys-lru")
    bb = 64 * 1024
    with make_store(server.url, block_bytes=bb) as s:
        n = 200  # 12.5 MiB of blocks into a 3 MiB server
        for i in range(0, n, 10):
            assert s.put(keys_of(10, base=i), blocks_of(10, bb, seed=i)) == [True] * 10
        used = int(server.info("memory")["used_memory"])  # type: ignore[call-overload]
        assert used <= 3 * 2**20 + bb * 2
        present = s.contains_many(keys_of(n))
        assert 0 < sum(present) < n
        assert present[-1]  # the newest survive under LRU
        # What survived is intact.
        got = s.get(keys_of(10, base=n - 10))
        ref = blocks_of(10, bb, seed=n - 10)
        assert all(g is None or np.array_equal(g, ref[j]) for j, g in enumerate(got))


def test_full_server_without_eviction_fails_stores_not_the_tier(
    redis_server_factory: RedisServerFactory,
) -> None:
    server = redis_server_factory(maxmemory="2mb", maxmemory_policy="noeviction")
    bb = 64 * 1024
    with make_store(server.url, block_bytes=bb) as s:
        results: list[bool] = []
        for i in range(0, 100, 10):
            results += s.put(keys_of(10, base=i), blocks_of(10, bb, seed=i))
        assert any(results) and not all(results)
        assert s.available  # OOM refusals are not an outage
        assert s.get(keys_of(1))[0] is not None


# -- two processes on one server ------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvoffload.tiers.redis.store import RedisBlockStore

    url, action = sys.argv[1], sys.argv[2]
    s = RedisBlockStore(url, "shared", 4096, geometry_fingerprint="g", hash_fn="xxhash64")
    keys = [i.to_bytes(8, "big") for i in range(32)]
    data = np.random.default_rng(42).integers(0, 256, (32, 4096), dtype=np.uint8)
    if action == "store":
        assert all(s.put(keys, data))
    else:
        out = np.zeros_like(data)
        assert all(s.get_into(keys, out)), "child missed blocks the parent stored"
        assert np.array_equal(out, data)
    print("ok")
    """
)


def _child(url: str, action: str) -> None:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, url, action],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_two_processes_share_one_server(redis_server: RedisServer) -> None:
    keys = [i.to_bytes(8, "big") for i in range(32)]
    data = np.random.default_rng(42).integers(0, 256, (32, 4096), dtype=np.uint8)
    s = RedisBlockStore(
        redis_server.url, "shared", 4096, geometry_fingerprint="g", hash_fn="xxhash64"
    )
    _child(redis_server.url, "store")  # another process stores ...
    out = np.zeros_like(data)
    assert s.get_into(keys, out) == [True] * 32  # ... this one loads
    assert np.array_equal(out, data)
    s.clear()
    s.put(keys, data)  # and the other way round
    _child(redis_server.url, "load")
    s.close()


def test_failed_probes_back_off(redis_server: RedisServer) -> None:
    s = make_store(redis_server.url, retry_interval_s=0.001, max_retry_interval_s=0.004)
    redis_server.kill()
    s.get(keys_of(1))
    assert s._links.breakers()[0]._interval == 0.001
    for _ in range(4):
        s.ping()  # a forced probe that fails
    assert s._links.breakers()[0]._interval == 0.004  # doubled, capped
    redis_server.start()
    assert s.ping() and s.available
    redis_server.kill()
    s.get(keys_of(1))
    assert s._links.breakers()[0]._interval == 0.001  # a new outage starts from the short interval
    s.close()


def test_replies_are_parsed_by_hiredis_where_installed() -> None:
    pytest.importorskip("hiredis")
    s = RedisBlockStore("redis://127.0.0.1:1/0", "p", 64, check_connection=False)
    try:
        assert s.parser == "hiredis"
    finally:
        s.close()
