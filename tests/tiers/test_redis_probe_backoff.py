"""``Prober``'s flap back-off: a target that fails again soon after a probe reopened it
is probed ever less often (doubling, capped); one that stayed up a long while starts over
at the base interval.

The prober's clock is replaced by a counter the test moves, so no assertion depends on
wall-clock time: real threads run, each probe answers at once, and the test only reads
the interval the prober chose when the target went down.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvoffload.tiers.redis import probe as probe_module
from kvoffload.tiers.redis.probe import Prober

BASE_S = 0.001
MAX_S = 0.008
FLAP_WINDOW_S = 5.0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(probe_module, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def _down_then_back(prober: Prober, answered: threading.Event) -> float:
    """The target goes down; return the interval chosen, after the probe reopened it."""
    answered.clear()
    prober.start()
    chosen = prober.interval_s
    assert answered.wait(10.0), "the probe never answered"
    thread = prober._thread
    assert thread is not None
    thread.join(10.0)
    return chosen


def test_flapping_doubles_the_interval_up_to_the_cap_and_a_long_uptime_resets_it(
    clock: _Clock,
) -> None:
    answered = threading.Event()
    prober = Prober("t", lambda: None, answered.set, BASE_S, MAX_S, FLAP_WINDOW_S)
    try:
        assert _down_then_back(prober, answered) == BASE_S  # first outage
        chosen = []
        for _ in range(5):  # fails again 1 s after each reopening: flapping
            clock.now += 1.0
            chosen.append(_down_then_back(prober, answered))
        assert chosen == [2 * BASE_S, 4 * BASE_S, MAX_S, MAX_S, MAX_S]
        clock.now += 10 * FLAP_WINDOW_S  # up for long: the next outage is a fresh one
        assert _down_then_back(prober, answered) == BASE_S
        assert prober.probes == 7
    finally:
        prober.close()
