"""A short Redis outage ends when the server is back, not when the back-off says so.

A real ``redis-server`` is frozen with SIGSTOP (connections stay open, nothing
answers: every call times out) for 8 s under a steady load of calls, then
resumed with SIGCONT. Before the prober, calls alone probed, with a doubling
wait: the tier came back about 8 s after the server did (the wait had grown
to 8 s). The prober's PING runs on its own schedule, so the return is seen
within one probe interval plus one timeout.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from kvoffload.tiers.redis.probe import PROBE_INTERVAL_S
from kvoffload.tiers.redis.store import RedisBlockStore
from tests.conftest_redis import RedisServer

BB = 64
TIMEOUT_S = 0.3
STOP_S = 8.0
# Generous: the prober needs one interval plus one timeout (~0.8 s); the old
# doubling back-off needed ~8 s here.
BACK_WITHIN_S = 4.0


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(36, "big") for i in range(n)]


def test_frozen_server_is_used_again_soon_after_it_resumes(redis_server: RedisServer) -> None:
    store = RedisBlockStore(
        redis_server.url,
        "outage",
        BB,
        timeout_s=TIMEOUT_S,
        retry_interval_s=1.0,
        max_retry_interval_s=30.0,
    )
    assert redis_server.proc is not None
    pid = redis_server.proc.pid
    try:
        assert all(store.put(_keys(4), np.ones((4, BB), np.uint8)))
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            # An engine's steady load: a lookup every 50 ms.
            while time.monotonic() - stopped_at < STOP_S:
                store.contains_many(_keys(4))
                time.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        assert not store.available
        (breaker,) = store._links.breakers()
        prober = getattr(breaker, "prober", None)
        probes_while_down = prober.probes if prober is not None else 0
        while not store.available:
            assert time.monotonic() - resumed_at < 60.0, "the tier never came back"
            store.contains_many(_keys(4))
            time.sleep(0.05)
        back_after = time.monotonic() - resumed_at
        assert back_after < BACK_WITHIN_S, f"back {back_after:.1f}s after the server"
        assert store.contains_many(_keys(4)) == [True] * 4
        # Its own schedule, and cheap: about one PING per interval (+ timeout), no more.
        assert prober is not None
        assert 2 <= probes_while_down <= STOP_S / PROBE_INTERVAL_S + 2
        assert store.stats.calls_skipped > 0  # calls did not each wait on the dead server
        # Probing stops once the target is up: the thread marks it up, then returns, so
        # on a busy machine it may still be finishing that return when we get here.
        deadline = time.monotonic() + 10.0
        while prober.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not prober.running
    finally:
        store.close()
