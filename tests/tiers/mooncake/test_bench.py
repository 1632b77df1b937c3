"""``kvoffload bench tiers`` measures Mooncake beside Redis in one run (tiny sizes)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.tiers.mooncake.required import need_mooncake

need_mooncake()

from kvoffload.bench.tiers import throughput as tiers  # noqa: E402
from tests.conftest_redis import RedisServer, redis_server, redis_server_factory  # noqa: E402

__all__ = ["redis_server", "redis_server_factory"]


def test_mooncake_beside_redis_with_ratios(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    p = argparse.ArgumentParser()
    tiers.add_arguments(p)
    args = p.parse_args(
        ["--block-sizes", "64KiB", "--total", "2MiB", "--batch", "8", "--skip-disk",
         "--redis-url", redis_server.url, "--json"]
    )  # fmt: skip
    assert tiers.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    (red,) = report["redis"]
    (mc,) = report["mooncake"]
    assert red["presence_us"] > 0
    for where in ("remote", "local"):
        assert mc[f"{where}_put_gbps"] > 0 and mc[f"{where}_get_gbps"] > 0
        assert mc[f"{where}_presence_us"] > 0
    assert mc["get_vs_redis"] > 0 and mc["presence_vs_redis"] > 0
    assert mc["redis_get_gbps"] == red["get_gbps"]  # ratios against this run's Redis row
