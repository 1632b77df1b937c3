"""A Redis that accepts connections and never answers, at start-up: one warning, not a crash."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvoffload.cli.main import main
from kvoffload.cli.preflight import check_redis_reachable
from tests.tiers.sockets import SilentServer


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def test_preflight_lets_a_silent_server_through(silent: SilentServer) -> None:
    check_redis_reachable(silent.url, timeout_s=0.1)  # no ValueError
    assert silent.accepted >= 1


def test_run_against_a_silent_redis_warns_once_and_serves(
    silent: SilentServer, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rc = main(["run", "--requests", "6", "--redis-url", silent.url])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "Traceback" not in captured.err and "not usable" not in captured.err
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "unreachable" in warnings[0].getMessage()
