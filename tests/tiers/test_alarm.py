"""FailingAlarm: one warning when failures start, one with the counts when they stop."""

from __future__ import annotations

import logging

import pytest

from kvoffload.tiers.alarm import FailingAlarm

log = logging.getLogger("tests.alarm")


def make() -> FailingAlarm:
    return FailingAlarm(
        log,
        ("blocks",),
        failing="tier {where}: {why} ({err}), {blocks} so far",
        recovered="tier {where}: back ({blocks} failed)",
        closed="tier {where}: closed failing ({blocks})",
        where="w",
    )


def test_transitions_only(caplog: pytest.LogCaptureFixture) -> None:
    a = make()
    with caplog.at_level(logging.WARNING, logger="tests.alarm"):
        a.succeeded()
        for _ in range(5):
            a.failed(OSError("full"), why="no room", blocks=2)
        assert a.count("blocks") == 10
        a.succeeded()
        a.succeeded()
        a.failed(OSError("again"), why="x", blocks=1)
        a.report_at_close()
    assert [r.getMessage() for r in caplog.records] == [
        "tier w: no room (full), 2 so far",
        "tier w: back (10 failed)",
        "tier w: x (again), 1 so far",
        "tier w: closed failing (1)",
    ]
