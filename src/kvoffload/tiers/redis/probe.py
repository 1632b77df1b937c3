"""Noticing that a Redis server is back: a cheap probe on its own schedule.

While a target is down its breaker skips every call (no engine thread waits
on a dead server). A :class:`Prober` thread sends one ``PING`` over a fresh
connection every ``interval_s`` (each probe bounded by the store's socket
timeout) and reopens the target at the first answer, so a server frozen for
a few seconds (``kill -STOP``, a failover, a GC pause) is back in use within
about ``interval_s`` + one timeout of its return, instead of after an
exponential back-off. One small request per interval is not hammering; a
target that flaps (answers the probe, then fails the next call within
``flap_window_s``) has its interval doubled, up to ``max_interval_s``, so a
half-broken server costs the engine at most one timeout per interval.

Invariant: at most one prober thread per target runs at a time, and it exits
as soon as the target is marked up or the prober is closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

logger = logging.getLogger(__name__)

#: Time between two probes of a down target (before any flapping).
PROBE_INTERVAL_S = 0.5
#: A target that fails again this soon after a probe reopened it is flapping.
FLAP_WINDOW_S = 5.0


def ping_on_fresh_connection(client: redis.Redis) -> Callable[[], None]:
    """A probe for ``client``'s server: PING on a new connection, never a pooled one.

    A pooled connection may be stuck behind a frozen server's unread replies;
    a fresh one says whether the server answers now. Raises on no answer.
    """

    def probe() -> None:
        conn = client.connection_pool.make_connection()
        try:
            conn.connect()
            conn.send_command("PING")
            conn.read_response()
        finally:
            conn.disconnect()

    return probe


class Prober:
    """Probes one down target until it answers (module docstring)."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], None],
        on_answer: Callable[[], None],
        interval_s: float = PROBE_INTERVAL_S,
        max_interval_s: float = 30.0,
        flap_window_s: float = FLAP_WINDOW_S,
    ) -> None:
        self.name = name
        self._probe = probe
        self._on_answer = on_answer
        self.base_interval_s = interval_s
        self.max_interval_s = max(max_interval_s, interval_s)
        self.flap_window_s = flap_window_s
        self.interval_s = interval_s
        self.probes = 0  # probes sent, for tests and stats
        self._reopened_at: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        """The target just went down: probe it (no-op while already probing or closed)."""
        with self._lock:
            if self._closed.is_set() or self.running:
                return
            now = time.monotonic()
            if self._reopened_at is not None and now - self._reopened_at < self.flap_window_s:
                self.interval_s = min(2 * self.interval_s, self.max_interval_s)
            else:
                self.interval_s = self.base_interval_s
            self._thread = threading.Thread(
                target=self._run, name=f"kvoffload-redis-probe-{self.name}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.probes += 1
            try:
                self._probe()
            except Exception:  # any failure means "not back yet"
                continue
            with self._lock:
                self._reopened_at = time.monotonic()
            self._on_answer()
            return

    def close(self, timeout_s: float = 2.0) -> None:
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
