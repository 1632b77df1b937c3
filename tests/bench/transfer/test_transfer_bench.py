"""``kvoffload bench transfer``: JSON shape, round-trip check, argument errors."""

from __future__ import annotations

import json

import pytest

from kvoffload.cli.main import main


def test_cli_json_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transfer", "--quick", "--blocks", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    results = out["results"]
    assert [r["block_bytes"] for r in results] == [16 << 10, 256 << 10]
    for r in results:
        assert {"block_bytes", "store_gbps", "load_gbps", "bulk_gbps"} <= r.keys()
        assert r["store_gbps"] > 0 and r["load_gbps"] > 0 and r["bulk_gbps"] > 0
        assert r["blocks"] == 16 and r["layout"] == "layer_first"


def test_cli_all_layouts_and_sequential(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transfer", "--sizes", "32KiB", "--blocks", "8", "--layout", "all"]
    assert main([*argv, "--pattern", "sequential", "--repeats", "1", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["layout"] for r in results] == ["layer_first", "kv_split", "cross_layer"]
    assert all(r["pattern"] == "sequential" and r["store_strategy"] == "runs" for r in results)


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transfer", "--sizes", "64KiB", "--blocks", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "store" in out and "bulk" in out and "64KiB" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "0"], "positive"),
        (["--sizes", "10KiB"], "not a whole number of tokens"),
        (["--blocks", "0"], "--blocks: must be positive"),
        (["--sizes", "lots"], "not a byte size"),
    ],
)
def test_cli_bad_values(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["bench", "transfer", *args]) == 2
    assert message in capsys.readouterr().err
