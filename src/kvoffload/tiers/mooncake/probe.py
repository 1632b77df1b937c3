"""The Mooncake tier's breaker: the first sign of a dead master or holder stops all calls.

A Mooncake client whose master has died answers its first call at once and
every later one after ~4.3 s (RPC_FAIL, -900; a get even answers with empty
bytes); a read from a dead segment holder costs ~0.5-1 s (TRANSFER_FAIL,
-800). An engine that kept calling would stall on every step. So the first
such code trips the breaker: from then on every call of the store answers at
once (misses, failed stores, nothing present) without touching the client,
and a :class:`Breaker` thread probes in the background every ``interval_s``:
a TCP connect to the master's port (bounded by ``connect_timeout_s``), then
one real presence call through the client (``confirm``). The first probe
that both answer closes the breaker: the tier is back in use within about
``interval_s`` of the master answering again (a restarted master has lost
every block's metadata: those blocks are then plain misses).

The outage is logged once when it starts and once, with the calls skipped,
when it ends. Invariants: at most one probe thread runs; it exits as soon as
the breaker closes or ``close`` is called; ``available`` is read without a
lock (a stale read costs at most one call that fails fast or one skipped).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from kvoffload.tiers.mooncake.client import MasterAddress

logger = logging.getLogger(__name__)

#: Time between two probes of a tripped breaker.
PROBE_INTERVAL_S = 0.25
#: Bound on the TCP connect of one probe.
CONNECT_TIMEOUT_S = 0.2


def master_answers(master: MasterAddress, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the master's RPC port accepts a TCP connection now (nothing is sent)."""
    try:
        with socket.create_connection((master.host, master.port), timeout=timeout_s):
            return True
    except OSError:
        return False


class Breaker:
    """Open (calls go through) until a down code; then tripped until a probe answers."""

    def __init__(
        self,
        master: MasterAddress,
        confirm: Callable[[], bool],
        *,
        interval_s: float = PROBE_INTERVAL_S,
        shown: str = "",
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.master = master
        self.interval_s = interval_s
        self._confirm = confirm
        self._shown = shown or master.addr
        self.available = True
        self.outages = 0
        self.calls_skipped = 0
        self.probes = 0
        self.tripped_at: float | None = None
        #: Seconds each finished outage lasted (tripped to reopened), for reports.
        self.outage_s: list[float] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def skip(self) -> bool:
        """True (and counted) when the call must not go out: the breaker is tripped."""
        if self.available:
            return False
        with self._lock:
            self.calls_skipped += 1
        return True

    def trip(self, why: str) -> None:
        """Stop every call and probe in the background (no-op while tripped or closed)."""
        with self._lock:
            if not self.available or self._closed.is_set():
                return
            self.available = False
            self.outages += 1
            self.tripped_at = time.monotonic()
            self._thread = threading.Thread(
                target=self._run, name="kvoffload-mooncake-probe", daemon=True
            )
            self._thread.start()
        logger.warning(
            "Mooncake tier at %s is unreachable (%s): calls are skipped (misses, stores "
            "dropped) and the master is probed every %.2fs",
            self._shown,
            why,
            self.interval_s,
        )

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.probes += 1
            if not master_answers(self.master):
                continue
            try:
                if not self._confirm():
                    continue
            except Exception:  # any failure means "not back yet"
                continue
            self._reopen()
            return

    def _reopen(self) -> None:
        with self._lock:
            self.available = True
            took = time.monotonic() - (self.tripped_at or time.monotonic())
            self.outage_s.append(took)
            skipped = self.calls_skipped
        logger.warning(
            "Mooncake tier at %s answers again after %.1fs (%d calls skipped meanwhile)",
            self._shown,
            took,
            skipped,
        )

    def close(self, timeout_s: float = 2.0) -> None:
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
