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


def test_cli_against_a_revision_interleaved(capsys: pytest.CaptureFixture[str]) -> None:
    """--against HEAD: both copy paths measured by their own processes, side by side."""
    argv = ["bench", "transfer", "--sizes", "32KiB", "--blocks", "8", "--device", "cpu"]
    assert main([*argv, "--against", "HEAD", "--rounds", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["against"] == ["HEAD"] and out["rounds"] == 2
    (row,) = out["results"]
    assert row["block_bytes"] == 32 << 10 and row["blocks"] == 8
    for name in ("this", "HEAD"):
        summary = row["revisions"][name]
        assert summary["rounds"] == 2 and summary["store_gbps"] > 0 and summary["load_gbps"] > 0
        lo, hi = summary["store_ratio_range"]
        assert lo <= summary["store_ratio"] <= hi
    assert row["this_over"]["HEAD"]["store"] > 0


def test_cli_against_an_unknown_revision_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "transfer", "--sizes", "32KiB", "--blocks", "8", "--device", "cpu"]
    assert main([*argv, "--against", "no-such-rev-xyz"]) == 2
    assert "no-such-rev-xyz" in capsys.readouterr().err
