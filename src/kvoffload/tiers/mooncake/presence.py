"""What the Mooncake master holds, learnt off the scheduler thread, minus what is known lost.

Presence is asked with ``batch_is_exist`` (one call per batch) by the
shared ``PresenceCache`` thread (``kvoffload.tiers.redis.presence``: lookups
answer at once from what is known; a block another engine stored is served
a step later), so the scheduler never waits on the master.

Mooncake keeps saying a block exists after the process holding its bytes
died, until the master drops that holder (its client TTL, 10 s by default):
every load of such a block would cost a failed transfer (~0.5-1 s) and be
offered again. ``LostKeys`` remembers the keys whose read failed that way for
``hold_s`` (default longer than the master's client TTL) and answers "absent"
for them whatever the master says; the store also removes them (forced), so a
later store writes them again.

Invariants: at most ``max_keys`` keys are remembered (oldest forgotten
first); a remembered key is forgotten when ``hold_s`` has passed or when this
process stores it again (``clear``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvoffload.tiers.redis.presence import ExistsFn, PresenceCache

#: Longer than the master's default client TTL (10 s).
LOST_HOLD_S = 15.0


class LostKeys:
    """Keys whose bytes were found unreachable, each for ``hold_s`` seconds."""

    def __init__(self, hold_s: float = LOST_HOLD_S, max_keys: int = 1 << 16) -> None:
        if hold_s < 0 or max_keys < 1:
            raise ValueError("hold_s must be >= 0 and max_keys positive")
        self.hold_s = hold_s
        self.max_keys = max_keys
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: Iterable[str]) -> None:
        until = time.monotonic() + self.hold_s
        with self._lock:
            for k in keys:
                self._until[k] = until
                self._until.move_to_end(k)
            while len(self._until) > self.max_keys:
                self._until.popitem(last=False)

    def clear(self, keys: Iterable[str]) -> None:
        if not self._until:
            return
        with self._lock:
            for k in keys:
                self._until.pop(k, None)

    def mask(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is remembered as lost now (expired ones are forgotten)."""
        if not self._until:
            return [False] * len(keys)
        now = time.monotonic()
        out: list[bool] = []
        with self._lock:
            for k in keys:
                until = self._until.get(k)
                if until is not None and until <= now:
                    del self._until[k]
                    until = None
                out.append(until is not None)
        return out

    def __len__(self) -> int:
        return len(self._until)


def make_presence(exists_fn: ExistsFn, *, linger_s: float = 0.0005) -> PresenceCache:
    """The presence thread over ``MooncakeBlockStore.contains_many``."""
    return PresenceCache(exists_fn, linger_s=linger_s)
