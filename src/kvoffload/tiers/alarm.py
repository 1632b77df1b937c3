"""One warning when a tier starts failing, one (with counts) when it works again.

A full filesystem fails every write for as long as it lasts; a Redis under
``noeviction`` refuses every store. A warning per failure would flood the
log, none would hide it. ``FailingAlarm`` keeps the state between the two
warnings and the counts of what failed meanwhile; each tier words its own
messages (``str.format`` templates over the counters and the fields given to
``failed``). Thread-safe; logging happens outside the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence


class FailingAlarm:
    """Failing / recovered state of one tier's writes, logged on transitions only.

    ``counters`` name the counts that ``failed(err, **counts)`` adds to;
    ``failing`` (formatted with the counts so far, ``err`` and the keyword
    fields given to ``failed``), ``recovered`` and ``closed`` (formatted with
    the counts since the first failure) are the three messages; ``context``
    (the tier's directory or URL) is a field of all three.
    """

    def __init__(
        self,
        log: logging.Logger,
        counters: Sequence[str],
        *,
        failing: str,
        recovered: str,
        closed: str,
        **context: object,
    ) -> None:
        self._log = log
        self._context = context
        self._names = tuple(counters)
        self._templates = (failing, recovered, closed)
        self._counts = dict.fromkeys(self._names, 0)
        self._lock = threading.Lock()
        self.failing = False

    def count(self, name: str) -> int:
        """Failures of ``name`` since the first failure (0 while all is well)."""
        with self._lock:
            return self._counts[name]

    def failed(self, err: BaseException, **fields: object) -> None:
        """Add the ``fields`` named by ``counters`` to the counts; warn on the first failure."""
        extra = {k: v for k, v in fields.items() if k not in self._counts}
        with self._lock:
            for name in self._names:
                self._counts[name] += int(fields.get(name, 0))  # type: ignore[call-overload]
            if self.failing:
                return
            self.failing = True
            counts = dict(self._counts)
        self._log.warning(self._templates[0].format(err=err, **self._context, **counts, **extra))

    def succeeded(self) -> None:
        """Work again: warn once with what failed meanwhile, and reset the counts."""
        if not self.failing:  # the common case, without the lock
            return
        with self._lock:
            if not self.failing:
                return
            self.failing = False
            counts = dict(self._counts)
            self._counts = dict.fromkeys(self._names, 0)
        self._log.warning(self._templates[1].format(**self._context, **counts))

    def report_at_close(self) -> None:
        """Closing while failing: say how much failed since the first failure."""
        with self._lock:
            if not self.failing:
                return
            counts = dict(self._counts)
        self._log.warning(self._templates[2].format(**self._context, **counts))


def refusal_alarm(log: logging.Logger, tier: str, url: str, advice: str) -> FailingAlarm:
    """A remote store's alarm (``tier``: "Redis", "Mooncake"): one warning when the store at
    ``url`` starts refusing puts (with ``advice``: what makes room), one with the count of
    refused puts when it accepts them again."""
    return FailingAlarm(
        log,
        ("count",),
        failing="{tier} tier at {url} refuses stores ({err}); they fail and are counted until "
        "it accepts them again ({advice})",
        recovered="{tier} tier at {url} accepts stores again ({count} were refused meanwhile)",
        closed="{tier} tier at {url}: closed while it refused stores ({count} refused)",
        tier=tier,
        url=url,
        advice=advice,
    )
