"""The Redis tier's outage breaker: what its warning keeps alive."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from kvoffload.tiers.redis.breaker import Breaker


class _Buffer:
    """Stands for a block buffer a failing call had in its frame."""


def _fail_holding(buf: _Buffer) -> None:
    held = buf  # noqa: F841 - kept in the frame on purpose
    raise ConnectionError("connection refused")


def test_an_outage_warning_keeps_no_frame_of_the_failed_call_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    breaker = Breaker("t", "redis://h:1", 0.5, 2.0)
    buf = _Buffer()
    ref = weakref.ref(buf)
    caplog.set_level(logging.WARNING)
    try:
        _fail_holding(buf)
    except ConnectionError as err:
        breaker.mark_down(err)
    del buf
    gc.collect()
    assert "is unreachable (ConnectionError: connection refused)" in caplog.text
    assert ref() is None  # the kept log record holds text, not the exception
