"""``kvoffload bench events`` runs and prints its figures (no timing is asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvoffload.bench.core import events as bench_events


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_events.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_json_report_has_both_profiles_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_events.run(_args("--batches", "50", "--events", "10", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["profiles"]) == {"vllm", "legacy"}
    for figures in report["profiles"].values():
        # Every batch is accounted for: live or replayed, nothing lost.
        assert figures["live_batches"] + figures["replayed_batches"] == 50
        assert figures["lost_batches"] == 0
    assert "send_batches_per_s_vllm_vs_legacy" in report["ratios"]


def test_table_output_and_bad_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_events.run(_args("--batches", "20", "--events", "5", "--profiles", "vllm")) == 0
    assert "KV events" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown profile"):
        bench_events.run(_args("--profiles", "json"))
