"""``kvoffload bench tiers`` runs end to end on tiny sizes and prints JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvoffload.bench.tiers import throughput as tiers
from tests.conftest_redis import RedisServer, redis_server, redis_server_factory

__all__ = ["redis_server", "redis_server_factory"]


def args_of(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tiers.add_arguments(p)
    return p.parse_args(list(argv))


def test_json_report(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    a = args_of(
        "--block-sizes", "64KiB", "--total", "1MiB", "--batch", "4",
        "--disk-dir", str(tmp_path / "d"), "--redis-url", redis_server.url, "--json",
        "--skip-mooncake",  # tests/tiers/mooncake/test_bench.py runs it
    )  # fmt: skip
    assert tiers.run(a) == 0
    report = json.loads(capsys.readouterr().out)
    (disk,) = report["disk"]
    assert disk["blocks"] == 16 and disk["put_gbps"] > 0 and disk["raw_read_gbps"] > 0
    assert disk["cross_layer_up_gbps"] > 0 and disk["layer_first_down_gbps"] > 0
    (red,) = report["redis"]
    assert red["get_gbps"] > 0 and red["raw_mget_gbps"] > 0
    assert list((tmp_path / "d").iterdir()) == []  # cleaned up after itself


def test_table_and_buffered_mode(capsys: pytest.CaptureFixture[str]) -> None:
    a = args_of(
        "--block-sizes", "8KiB", "--total", "64KiB", "--skip-redis", "--skip-mooncake", "--buffered"
    )  # fmt: skip
    assert tiers.run(a) == 0
    out = capsys.readouterr().out
    assert "buffered" in out and "8KiB" in out


def test_bad_sizes() -> None:
    with pytest.raises(SystemExit):  # refused by the flag's type, before any work
        args_of("--block-sizes", ",", "--skip-redis")
    args = args_of("--skip-redis")
    args.block_sizes = ","  # a caller building the namespace by hand
    with pytest.raises(ValueError):
        tiers.bench(args)
