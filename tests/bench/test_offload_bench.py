"""``kvoffload bench offload``: replay, Belady's bound, report and CLI."""

import json

import pytest

from kvoffload.bench.offload import belady_hit_rate, bench, build_trace, replay
from kvoffload.bench.workload import WorkloadConfig
from kvoffload.cli.main import main
from kvoffload.offload import DEFAULT_CACHE_POLICY, make_offload_key, policy_names

TINY = WorkloadConfig(
    num_requests=150, num_conversations=15, system_prompt_tokens=64, max_context_tokens=1200, seed=1
)


def k(c: str) -> bytes:
    return make_offload_key(c.encode() * 8)


def test_belady_on_a_hand_made_trace() -> None:
    a, b = k("a"), k("b")
    trace = [([a], [a]), ([b], [b]), ([a], [a])]
    # capacity 1: b is needed never again, so MIN bypasses it and a hits.
    assert belady_hit_rate(trace, 1) == pytest.approx(1 / 3)
    assert replay(trace, "lru", 1).hit_rate == 0.0
    assert replay(trace, "lru", 2).hit_rate == pytest.approx(1 / 3)


def test_belady_counts_only_prompt_blocks() -> None:
    a, out = k("a"), k("o")
    trace = [([a], [a, out]), ([a, out], [a, out])]
    assert belady_hit_rate(trace, 2) == pytest.approx(2 / 3)


def test_belady_bounds_every_policy() -> None:
    trace = build_trace(TINY, 16)
    for cap in (96, 384):  # above the longest request (75 blocks): no store refused
        bound = belady_hit_rate(trace, cap)
        for p in policy_names():
            r = replay(trace, p, cap)
            assert 0 < r.hit_rate <= bound <= 1
            assert r.block_ops > 0 and r.stores_refused == 0


def test_unlimited_capacity_misses_only_first_uses() -> None:
    trace = build_trace(TINY, 16)
    seen: set[bytes] = set()
    compulsory = 0
    for prompt, full in trace:
        compulsory += sum(1 for key in prompt if key not in seen)
        seen.update(full)
    total = sum(len(p) for p, _ in trace)
    expected = 1 - compulsory / total
    assert replay(trace, "arc", 10**6).hit_rate == pytest.approx(expected)
    assert belady_hit_rate(trace, 10**6) == pytest.approx(expected)


def test_report_shape() -> None:
    report = bench(TINY, 16, [32, 128], ["lru", "arc"])
    assert set(report["capacities"]) == {"32", "128"}  # type: ignore[arg-type]
    rows = report["results"]
    assert len(rows) == 4  # type: ignore[arg-type]
    for row in rows:  # type: ignore[union-attr]
        assert {"policy", "capacity", "hit_rate", "ops_per_s", "belady_hit_rate", "vs_lru"} <= set(
            row
        )
    json.dumps(report)


def test_default_policy_is_the_best_at_both_default_capacities() -> None:
    report = bench(WorkloadConfig(), 16, [2048, 8192], policy_names())
    for summary in report["capacities"].values():  # type: ignore[union-attr]
        assert summary["best_policy"] == DEFAULT_CACHE_POLICY
        assert summary["best_hit_rate"] >= summary["lru_hit_rate"]
        assert summary["best_hit_rate"] <= summary["belady_hit_rate"]


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "offload", "--requests", "80", "--conversations", "10"]
    assert main([*args, "--capacities", "32,64", "--policies", "lru,sieve", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 80 and len(out["results"]) == 4


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "offload", "--requests", "60", "--conversations", "10", "--capacities", "64"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "MIN" in text and "lru" in text and "default policy" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--capacities", "0"], "capacities must be positive"),
        (["--policies", "nope"], "unknown cache policy"),
        (["--block-size", "0"], "block-size"),
        (["--requests", "0"], "num_requests"),
    ],
)
def test_cli_bad_values(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    assert main(["bench", "offload", *extra]) == 2
    assert message in capsys.readouterr().err
