"""Engine statistics in bounded memory.

A long-lived engine serves requests for ever, so nothing here grows with the
number of requests served: counters are plain ints, and latency percentiles
come from a fixed-size window of the most recent values, kept in a
preallocated ``array`` (one C double per slot, no Python object per value).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

DEFAULT_WINDOW = 4096


class LatencyWindow:
    """Count, mean and max of every value, percentiles over the last ``window``.

    Invariant: memory is ``O(window)`` whatever the number of ``add`` calls.
    Percentiles use linear interpolation between closest ranks (numpy's
    default), over the values still in the window.
    """

    __slots__ = ("_next", "_values", "count", "max", "total", "window")

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._values = array("d", bytes(8 * window))
        self._next = 0
        self.count = 0
        self.total = 0.0
        self.max = -math.inf

    def add(self, value: float) -> None:
        self._values[self._next] = value
        self._next = (self._next + 1) % self.window
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def recent(self) -> list[float]:
        """The values in the window, oldest first."""
        n = min(self.count, self.window)
        if n < self.window:
            return list(self._values[:n])
        return list(self._values[self._next :]) + list(self._values[: self._next])

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the window; 0.0 when empty."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {q}")
        values = sorted(self.recent())
        if not values:
            return 0.0
        rank = (len(values) - 1) * q / 100
        lo = math.floor(rank)
        hi = min(lo + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (rank - lo)


@dataclass
class EngineStats:
    """Totals since the engine started; latencies as bounded windows.

    Per-request outputs are handed to the caller by ``step()`` and not kept.
    """

    steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    gpu_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    preemptions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    ttft_s: LatencyWindow = field(default_factory=LatencyWindow)
    latency_s: LatencyWindow = field(default_factory=LatencyWindow)
