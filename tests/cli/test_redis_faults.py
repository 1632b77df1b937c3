"""Redis faults through ``kvoffload run``: each ends in misses or one warning, never a crash.

- a server that accepts connections and never answers, at start-up;
- a server under ``maxmemory`` + ``allkeys-lru`` that evicts blocks while
  the run looks them up and loads them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvoffload.cli.main import main
from kvoffload.cli.preflight import check_redis_reachable
from tests.conftest_redis import RedisServerFactory
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


def test_run_against_an_evicting_redis_completes(
    redis_server_factory: RedisServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    # 1 MiB above what the empty server uses (its blocks come to about 4 MiB): a fixed
    # 1mb left 84 KB over a 964 KB baseline, and where a build's baseline or the tier's
    # connections took more, the first write was refused with no key to evict.
    server = redis_server_factory(maxmemory_policy="allkeys-lru")
    baseline = int(server.info("memory")["used_memory"])  # type: ignore[call-overload]
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)
    try:
        client.config_set("maxmemory", baseline + (1 << 20))
    finally:
        client.close()
    argv = ["run", "--requests", "48", "--cpu-blocks", "32", "--redis-url", server.url]
    assert main(argv) == 0, capsys.readouterr().err
    assert int(server.info("stats")["evicted_keys"]) > 0  # type: ignore[call-overload]
