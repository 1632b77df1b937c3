"""The hybrid-sched rig at a tiny size: both specs on vLLM's real scheduler, one JSON object."""

from __future__ import annotations

from tests.vllm_required import need_vllm

need_vllm()

import argparse  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from tests.rigs import hybrid_sched, sched_side  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    hybrid_sched.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_layer_kinds_give_the_asked_number_of_groups() -> None:
    assert sched_side.layer_kinds(2, 128).count(("full", None)) == 2
    assert sched_side.layer_kinds(4, 1024).count(("sliding", 1024)) == 6


def test_tiny_run_prints_one_json_object_with_both_specs(
    capsys: pytest.CaptureFixture,
) -> None:
    args = _args(
        "--requests", "10", "--prompt-tokens", "8192", "--groups", "2", "--windows", "128",
        "--cpu-fraction", "0.5", "--json",
    )  # fmt: skip
    assert hybrid_sched.run(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (point,) = report["points"]
    assert point["layout"] == "2g-w128"
    ours, theirs = point["sides"]["kvoffload"], point["sides"]["vllm"]
    conn = point["sides"]["kvoffload-conn"]
    for side in (ours, conn, theirs):
        assert side["steps"] > 0 and side["prompt_tokens"] > 0
        assert side["stored_keys"] > 0
        assert len(side["bytes_per_chunk_per_group"]) == 2
        assert all(b > 0 for b in side["bytes_per_chunk_per_group"])
        assert side["connector_us_per_step"] > 0
    # Same requests, same CPU bytes; revisits past the small GPU pool hit the CPU tier.
    assert ours["cached_tokens"] > 0 and theirs["cached_tokens"] > 0 and conn["cached_tokens"] > 0
    assert ours["prompt_tokens"] == theirs["prompt_tokens"]
    assert ours["cpu_slots"] == theirs["cpu_slots"] > 0
    assert point["step_time_ratio"] is not None and point["hit_rate_ratio"] is not None


def test_the_table_prints_ratios(capsys: pytest.CaptureFixture) -> None:
    args = _args("--requests", "3", "--prompt-tokens", "2048", "--groups", "2", "--windows", "32")
    assert hybrid_sched.run(args) == 0
    out = capsys.readouterr().out
    assert "ours/vLLM" in out and "conn/vLLM" in out and "2g-w32" in out
