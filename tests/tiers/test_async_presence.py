"""Redis presence off the scheduler thread: lookups answer at once, hits come a step later."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.redis.presence import PresenceCache
from tests.conftest_redis import RedisServer
from tests.tiers.sockets import GatedProxy
from tests.tiers.tier_rig import Rig, tkey


class Server:
    """A fake ``exists_fn``: a set of keys, a call log, and a gate to hold calls."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.calls: list[list[bytes]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self.entered.set()
        self.gate.wait()
        self.calls.append(list(keys))
        return [k in self.keys for k in keys]


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.gate.set()


def test_unknown_keys_are_answered_now_and_asked_in_one_batch(server: Server) -> None:
    server.keys = {b"a", b"c"}
    p = PresenceCache(server.exists, linger_s=0)
    server.gate.clear()
    try:
        assert p.known([b"a", b"b"]) == [None, None]  # answered at once: nothing known yet
        assert server.entered.wait(10)
        assert p.known([b"c", b"d", b"a"]) == [None, None, None]  # queued, a is in flight
        server.gate.set()
        assert p.wait_idle(10)
        assert p.known([b"a", b"b", b"c", b"d"]) == [True, False, True, False]
        assert p.round_trips == 2 and sorted(server.calls[1]) == [b"c", b"d"]
    finally:
        p.close()


def test_one_round_trip_for_a_burst_of_lookups(server: Server) -> None:
    server.gate.clear()  # hold the thread until the whole burst is queued
    p = PresenceCache(server.exists, linger_s=0)
    try:
        p.known([b"warm"])
        assert server.entered.wait(10)
        for i in range(50):
            p.known([f"k{i}".encode()])
        server.gate.set()
        assert p.wait_idle(10)
        assert p.round_trips == 2 and len(server.calls[1]) == 50
    finally:
        p.close()


def test_memory_is_bounded() -> None:
    p = PresenceCache(lambda ks: [True] * len(ks), max_entries=8, max_pending=4, linger_s=0)
    try:
        for i in range(40):
            p.known([f"k{i}".encode() for _ in range(3)])
            p.wait_idle(10)
        assert len(p) <= 8
        assert len(p._pending) <= 4
    finally:
        p.close()


def test_what_this_process_learns_wins_over_a_probe_in_flight(server: Server) -> None:
    server.keys = {b"k"}
    p = PresenceCache(server.exists, linger_s=0)
    server.gate.clear()
    try:
        p.known([b"k"])
        assert server.entered.wait(10)
        p.mark([b"k"], False)  # a read found nothing while the probe was out
        server.gate.set()
        assert p.wait_idle(10)
        assert p.known([b"k"]) == [False]
    finally:
        p.close()


def test_manager_never_calls_the_server_on_the_caller_thread(server: Server) -> None:
    caller = threading.get_ident()
    threads: list[int] = []

    def exists(keys: Sequence[bytes]) -> list[bool]:
        threads.append(threading.get_ident())
        return server.exists(keys)

    ks = [tkey(i) for i in range(3)]
    server.keys = {bytes(k) for k in ks}
    m = RemoteOffloadingManager(exists, presence=PresenceCache(exists, linger_s=0))
    try:
        assert m.lookup(ks) == 0  # not known yet: a miss now
        m.presence.wait_idle(10)  # type: ignore[union-attr]
        assert m.lookup(ks) == 3  # a step later: the hit
        out = m.prepare_store([tkey(9)])
        assert out.keys_to_store == [tkey(9)]
        m.complete_store([tkey(9)])
        assert m.lookup([tkey(9)]) == 1  # own stores are known at once
        m.drop(ks[:1])
        assert m.lookup(ks) == 0  # a failed read: absent until the server says otherwise
        m.hint_queued("r", [tkey(7)])
        m.presence.wait_idle(10)  # type: ignore[union-attr]
        assert threads and caller not in threads
    finally:
        m.close()


def test_lookups_do_not_wait_for_a_slow_real_redis(redis_server: RedisServer) -> None:
    """Through a proxy holding every reply: a lookup that needed one would never return."""
    proxy = GatedProxy(redis_server.port)
    a = Rig(cpu_blocks=4, redis_url=redis_server.url)
    b = Rig(cpu_blocks=4, redis_url=proxy.url, redis_async_presence=True, redis_timeout_s=30)
    ids = list(range(3))
    ks = [tkey(i) for i in ids]
    try:
        for i in range(8):
            assert a.store([i])  # 0..3 end in Redis (write-back)
        b.truth.update(a.truth)
        results: list[int] = []
        with proxy.hold():
            t = threading.Thread(target=lambda: results.append(b.m.lookup(ks)))
            t.start()
            t.join(timeout=60)  # a hang detector, not a timing assertion
            assert not t.is_alive(), "lookup waited for Redis"
        assert results == [0]  # nothing known yet: recomputed now, served a step later
        t.join()
        remote = b.m.lower[0]
        assert isinstance(remote, RemoteOffloadingManager) and remote.presence is not None
        assert remote.presence.wait_idle(60)
        assert b.load(ids) == (3, True)  # bytes checked against a's
        # A queued request's keys are asked before its lookup (hint_queued).
        more = [tkey(3)]
        b.truth[more[0]] = a.truth[more[0]]
        b.m.hint_queued("req", more)
        assert remote.presence.wait_idle(60)
        assert b.load([3]) == (1, True)
    finally:
        b.close()
        a.close()
        proxy.close()


def test_the_tiered_manager_says_when_a_lookup_may_grow(server: Server) -> None:
    from kvoffload.offload import CPUOffloadingManager
    from kvoffload.tiers.tiered_manager import TieredOffloadingManager

    ks = [tkey(i) for i in range(3)]
    server.keys = {bytes(k) for k in ks[:2]}
    remote = RemoteOffloadingManager(server.exists, presence=PresenceCache(server.exists))
    m = TieredOffloadingManager(CPUOffloadingManager(4, "lru"), [remote])
    try:
        server.gate.clear()
        assert m.lookup(ks) == 0 and m.lookup_pending(ks, 0)  # being asked: try next step
        server.gate.set()
        assert remote.presence is not None and remote.presence.wait_idle(10)
        assert m.lookup(ks) == 2 and not m.lookup_pending(ks, 2)  # asked: ks[2] is absent
        assert not m.lookup_pending(ks, 3)
    finally:
        remote.close()
