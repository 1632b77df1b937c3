"""What the Redis server holds, learnt off the scheduler thread: lookups never wait on it.

``PresenceCache.known(keys)`` answers at once from what is known now: True
(present when last asked), False (absent when last asked), None (never
asked). Keys not known present are queued; a background thread drains the
queue in one pipelined round trip (``exists_fn``, e.g.
``RedisBlockStore.contains_many``) per batch. Lookups issued within
``linger_s`` of each other (one scheduler step's) share a batch, so a
step costs at most one round trip, on that thread, however many keys it
looks up. A block another engine stored is therefore served from the step
after the one that first asked about it.

Invariants: at most ``max_entries`` answers are kept (least recently used
forgotten first) and at most ``max_pending`` keys wait (more are dropped and
asked again on their next lookup), so memory is bounded. An answer can be
stale: a key said present may have been evicted since; the load then fails
and the engine recomputes (``TieredOffloadingManager.prepare_load``), and
the caller ``forget``s or ``mark``s the key absent. What this process
learns itself (a store completed, a read that found nothing) is ``mark``ed
at once and wins over a probe that was already in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

ExistsFn = Callable[[Sequence[bytes]], list[bool]]


class PresenceCache:
    """Known presence of keys on a shared server, refreshed by one background thread."""

    def __init__(
        self,
        exists_fn: ExistsFn,
        *,
        max_entries: int = 1 << 16,
        max_pending: int = 1 << 14,
        linger_s: float = 0.0005,
    ) -> None:
        if max_entries < 1 or max_pending < 1:
            raise ValueError("max_entries and max_pending must be positive")
        self._exists = exists_fn
        self.max_entries = max_entries
        self.max_pending = max_pending
        self.linger_s = linger_s
        self._known: OrderedDict[bytes, bool] = OrderedDict()
        self._pending: dict[bytes, None] = {}
        self._in_flight: set[bytes] = set()
        self._marked: set[bytes] = set()  # marked while a probe was in flight: the mark wins
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.round_trips = 0
        self.keys_asked = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-presence", daemon=True)
        self._thread.start()

    # -- the scheduler thread's side ----------------------------------------

    def known(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Per key, what is known now; keys not known present are queued to be asked."""
        out: list[bool | None] = []
        ask: list[bytes] = []
        with self._cond:
            known = self._known
            for k in keys:
                k = bytes(k)
                v = known.get(k)
                if v is not None:
                    known.move_to_end(k)
                if v is not True:
                    ask.append(k)
                out.append(v)
            if ask:
                self._queue(ask)
        return out

    def unanswered(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the server has not been asked about it yet (a lookup may wait)."""
        with self._cond:
            known = self._known
            return [bytes(k) not in known for k in keys]

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Queue ``keys`` that are not known present (a request that will look them up)."""
        with self._cond:
            known = self._known
            self._queue([k for k in map(bytes, keys) if known.get(k) is not True])

    def mark(self, keys: Iterable[bytes], present: bool) -> None:
        """What this process knows for certain now (its own store landed, a read missed)."""
        with self._cond:
            for k in map(bytes, keys):
                self._set(k, present)
                self._pending.pop(k, None)
                if k in self._in_flight:
                    self._marked.add(k)

    def forget(self, keys: Iterable[bytes] | None = None) -> None:
        """Drop what is known about ``keys`` (all keys when None)."""
        with self._cond:
            if keys is None:
                self._known.clear()
                self._pending.clear()
                self._marked.update(self._in_flight)
                return
            for k in map(bytes, keys):
                self._known.pop(k, None)
                self._pending.pop(k, None)
                if k in self._in_flight:
                    self._marked.add(k)

    def __len__(self) -> int:
        with self._cond:
            return len(self._known)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being asked (tests, benchmarks); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # -- internals ----------------------------------------------------------

    def _queue(self, keys: list[bytes]) -> None:
        pending = self._pending
        room = self.max_pending - len(pending)
        added = False
        for k in keys:
            if k in pending or k in self._in_flight:
                continue
            if room <= 0:
                break  # asked again on its next lookup
            pending[k] = None
            room -= 1
            added = True
        if added:
            self._cond.notify_all()

    def _set(self, k: bytes, present: bool) -> None:
        known = self._known
        known[k] = present
        known.move_to_end(k)
        while len(known) > self.max_entries:
            known.popitem(last=False)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._busy = True
            if self.linger_s > 0:
                time.sleep(self.linger_s)  # let the rest of this step's lookups join the batch
            with self._cond:
                batch = list(self._pending)
                self._pending.clear()
                self._in_flight.update(batch)
            try:
                answers = self._exists(batch)
            except Exception as exc:  # the store reports outages itself; keep the thread alive
                logger.debug("presence probe failed: %s", exc)
                answers = [False] * len(batch)
            with self._cond:
                self.round_trips += 1
                self.keys_asked += len(batch)
                marked = self._marked
                for k, there in zip(batch, answers):
                    if k not in marked:
                        self._set(k, bool(there))
                self._in_flight.clear()
                marked.clear()
                self._busy = bool(self._pending)
                self._cond.notify_all()
