"""kvoffload run --verify, the engine flags added for hashing/events/threads, bench threads."""

import json

from kvoffload.cli.main import main


def test_run_verify_reports_identical_rows_and_tokens(capsys) -> None:
    assert main(["run", "--verify", "--requests", "8", "--store-mode", "lazy"]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("verify:"))
    assert line.endswith("logits rows differ, 0 tokens differ") and line.startswith("verify: 0 of ")


def test_run_verify_json_and_refuses_offload_off(capsys) -> None:
    assert main(["run", "--verify", "--requests", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["verify"]["identical"] and report["verify"]["rows_total"] > 0
    assert [r["label"] for r in report["results"]] == ["off", "eager"]
    assert main(["run", "--verify", "--store-mode", "off", "--requests", "2"]) == 2
    assert "--verify" in capsys.readouterr().err


def test_verify_compare_counts_bitwise_differences() -> None:
    import torch

    from kvoffload.engine.demo.verify import RecordedRequest, compare

    rows = torch.randn(3, 16)
    flipped = rows.clone()
    flipped[1, 5] = torch.nextafter(flipped[1, 5], torch.tensor(float("inf")))
    neg_zero = rows.clone()
    neg_zero[2, 0] = 0.0
    pos = rows.clone()
    pos[2, 0] = -0.0
    ref = {"a": RecordedRequest([1, 2, 3], rows), "b": RecordedRequest([4, 5, 6], neg_zero)}
    other = {"a": RecordedRequest([1, 2, 9], flipped), "b": RecordedRequest([4, 5, 6], pos)}
    report = compare(ref, other)
    assert (report.rows_total, report.rows_differing) == (6, 2)  # one ulp; -0.0 vs 0.0
    assert (report.tokens_total, report.tokens_differing) == (6, 1)
    assert report.line() == "verify: 2 of 6 logits rows differ, 1 tokens differ"
    assert not report.identical and report.max_abs_diff > 0
    missing = compare(ref, {"a": other["a"]})
    assert missing.requests_missing == 1 and missing.rows_differing == 1 + 3
    assert compare(ref, ref).identical


def test_hash_seed_and_events_format_flags_reach_the_config() -> None:
    import argparse

    from kvoffload.cli.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    cfg = engine_config_from_args(
        parser.parse_args(["--hash-seed", "42", "--events-format", "legacy", "--threads", "1"])
    )
    assert (cfg.hash_seed, cfg.events_format, cfg.num_threads) == ("42", "legacy", 1)
    default = engine_config_from_args(parser.parse_args([]))
    assert (default.hash_seed, default.events_format, default.num_threads) == (None, "vllm", None)


def test_bench_threads_json(capsys) -> None:
    # Times are printed, never asserted: the machine may be loaded.
    assert main(["bench", "threads", "--requests", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["quiet_wall_s"] > 0 and report["busy_wall_s"] > 0 and report["ratio"] > 0
    assert len(report["quiet_runs"]) == len(report["busy_runs"]) == 1
    assert main(["bench", "threads", "--env", "NOEQUALS"]) == 2
