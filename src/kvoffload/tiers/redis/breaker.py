"""The outage state of one Redis target: skip it while it is down, notice when it is back.

A target that fails to answer is skipped (its keys are misses, its stores
fail) for ``retry_interval_s``, then one call tries it again, the wait
doubling per failure up to ``max_retry_interval_s`` (so callers pay at most
one timeout per wait). Meanwhile a ``Prober`` (``probe``) sends one PING on a
fresh connection every ``PROBE_INTERVAL_S`` off the callers' threads and
reopens the target at the first answer, so a short outage ends within about
a second of the server's return however long the back-off has grown. The
outage is logged once when it starts and once when the target is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.exceptions import RedisClusterException

from kvoffload.tiers.redis.probe import PROBE_INTERVAL_S, Prober

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors that mean "the target did not answer" (not "the target refused").
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    RedisClusterException,
)


class Breaker:
    """The outage state of one target; see the module docstring."""

    def __init__(
        self,
        name: str,
        shown: str,
        retry_interval_s: float,
        max_retry_interval_s: float,
        log: logging.Logger = logger,
        probe: Callable[[], None] | None = None,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.name = name
        self.log = log
        self.shown = shown
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max(max_retry_interval_s, retry_interval_s)
        self.outages = 0
        self.calls_skipped = 0
        self._interval = retry_interval_s
        self._down_until = 0.0
        self._down_since: float | None = None
        self._lock = threading.Lock()
        # With a probe, a down target is also reopened as soon as it answers a PING.
        self.prober = (
            None
            if probe is None
            else Prober(
                name,
                probe,
                self.mark_up,
                min(probe_interval_s, max(retry_interval_s, 0.01)),
                self.max_retry_interval_s,
            )
        )

    @property
    def up(self) -> bool:
        return self._down_since is None

    def mark_down(self, err: BaseException) -> None:
        with self._lock:
            if self._down_since is None:
                self._interval = self.retry_interval_s
            else:
                self._interval = min(2 * self._interval, self.max_retry_interval_s)
            self._down_until = time.monotonic() + self._interval
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
                self.outages += 1
        if self.prober is not None:
            self.prober.start()
        if not first:
            return
        retry = (
            f"next try in {self.retry_interval_s:.1f}s, backing off to "
            f"{self.max_retry_interval_s:.1f}s"
        )
        if self.prober is not None:
            retry += f"; probed every {self.prober.interval_s:.1f}s"
        self.log.warning(
            "Redis tier at %s is unreachable (%s: %s); its loads are misses and its "
            "stores fail until it is back (%s)",
            self.shown,
            type(err).__name__,
            # The text, not the exception: a handler that keeps records (pytest's
            # does) would keep its traceback's frames, and the buffers they hold, alive.
            str(err),
            retry,
        )

    def mark_up(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is None:
                return
            down_for = time.monotonic() - self._down_since
            self._down_since = None
        self.log.warning(
            "Redis tier at %s is back after %.1fs (%d calls skipped meanwhile)",
            self.shown,
            down_for,
            self.calls_skipped,
        )

    def probe_now(self) -> None:
        with self._lock:
            self._down_until = 0.0

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()

    def guarded(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``, or ``fallback`` while down or when the target does not answer."""
        if self._down_since is not None and time.monotonic() < self._down_until:
            self.calls_skipped += 1
            return fallback
        try:
            out = fn()
        except OUTAGE_ERRORS as e:
            self.mark_down(e)
            return fallback
        self.mark_up()
        return out
