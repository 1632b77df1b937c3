"""``kvoffload bench offload``: replay, Belady's bound, the ceiling, report and CLI."""

import json
from pathlib import Path

import pytest

from kvoffload.bench import offload_vllm
from kvoffload.bench.mooncake import MooncakeRequest
from kvoffload.bench.offload import (
    belady_hit_rate,
    bench,
    ceiling_hit_rate,
    parse_capacity,
    replay,
)
from kvoffload.bench.traces import KINDS, generate, load_trace, save_trace, trace_keys
from kvoffload.cli.main import main
from kvoffload.offload import DEFAULT_CACHE_POLICY, make_offload_key, policy_names


def k(c: str) -> bytes:
    return make_offload_key(c.encode() * 8)


def ids_trace(*requests: list[int]) -> list[list[bytes]]:
    return trace_keys(
        [MooncakeRequest(float(i), 512 * len(r), 0, r) for i, r in enumerate(requests)]
    )


def test_belady_on_a_hand_made_trace() -> None:
    a, b = k("a"), k("b")
    trace = [[a], [b], [a]]
    # capacity 1: b is needed never again, so MIN bypasses it and a hits.
    assert belady_hit_rate(trace, 1) == pytest.approx(1 / 3)
    assert replay(trace, "lru", 1).hit_rate == 0.0
    assert replay(trace, "lru", 2).hit_rate == pytest.approx(1 / 3)


def test_ceiling_misses_only_first_uses() -> None:
    trace = ids_trace([1, 2, 3], [1, 2, 4], [1, 5])
    assert ceiling_hit_rate(trace) == pytest.approx(3 / 8)
    assert replay(trace, "lru", 100).hit_rate == pytest.approx(3 / 8)
    assert belady_hit_rate(trace, 100) == pytest.approx(3 / 8)


@pytest.mark.parametrize("kind", KINDS)
def test_belady_bounds_every_policy_and_the_ceiling_bounds_belady(kind: str) -> None:
    trace = trace_keys(generate(kind, 150, seed=3))
    ceiling = ceiling_hit_rate(trace)
    longest = max(len(t) for t in trace)
    for cap in (longest, 2 * longest):  # a store always fits: none refused
        bound = belady_hit_rate(trace, cap)
        assert bound <= ceiling + 1e-12
        for p in policy_names():
            r = replay(trace, p, cap)
            assert r.hit_rate <= bound + 1e-12, (p, cap)
            assert r.block_ops > 0 and r.stores_refused == 0


def test_generators_are_seeded_and_chain_shaped() -> None:
    a, b = generate("mixed", 200, seed=7), generate("mixed", 200, seed=7)
    assert a == b and a != generate("mixed", 200, seed=8)
    seen: dict[int, tuple[int, ...]] = {}
    for r in a:
        for i, h in enumerate(r.hash_ids):  # an id always has the same prefix before it
            assert seen.setdefault(h, tuple(r.hash_ids[:i])) == tuple(r.hash_ids[:i])
    with pytest.raises(ValueError, match="known"):
        generate("nope", 10)


def test_trace_round_trip(tmp_path: Path) -> None:
    reqs = generate("rag", 30, seed=1)
    save_trace(reqs, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == reqs


@pytest.mark.parametrize("policy", sorted({"arc_admit", "lru_admit", DEFAULT_CACHE_POLICY}))
def test_admission_beats_lru_on_a_scan_heavy_trace(policy: str) -> None:
    # A hot prefix read again and again, with two one-off scans in between
    # (40 blocks: more than the tier) that flush LRU; second-sighting admission
    # keeps the scans in the slots of earlier scans, out of the hot prefix's way.
    reqs = []
    scan = 1000
    for _ in range(60):
        reqs.append(list(range(10)))
        for _ in range(2):
            reqs.append([scan + j for j in range(20)])
            scan += 20
    trace = ids_trace(*reqs)
    lru = replay(trace, "lru", 32).hit_rate
    ours = replay(trace, policy, 32).hit_rate
    assert lru < 0.05
    assert ours > lru + 0.15
    assert ours <= belady_hit_rate(trace, 32)


def test_parse_capacity() -> None:
    assert parse_capacity("10%", 1000) == 100
    assert parse_capacity("0.01%", 1000) == 1
    assert parse_capacity("64", 1000) == 64
    for bad in ("0", "-3", "x", "0%", "%"):
        with pytest.raises(ValueError):
            parse_capacity(bad, 1000)


def test_report_shape_and_summary() -> None:
    trace = trace_keys(generate("chat", 200, seed=2))
    report = bench(trace, ["5%", "64"], ["lru", "arc", DEFAULT_CACHE_POLICY], with_vllm=False)
    assert set(report["capacities"]) == {"5%", "64"}  # type: ignore[arg-type]
    rows = report["results"]
    assert len(rows) == 6  # type: ignore[arg-type]
    for row in rows:  # type: ignore[union-attr]
        assert {"policy", "capacity", "hit_rate", "ops_per_s", "label"} <= set(row)
    for s in report["capacities"].values():  # type: ignore[union-attr]
        assert s["best_hit_rate"] <= s["belady_hit_rate"] <= report["ceiling_hit_rate"]
    assert "not requested" in report["vllm"]  # type: ignore[operator]
    json.dumps(report)


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="known"):
        bench(ids_trace([1]), ["1"], ["lfu"], with_vllm=False)


def test_cli_json_and_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.jsonl"
    save_trace(generate("mixed", 120, seed=5), path)
    args = ["bench", "offload", "--trace", str(path), "--capacity", "2%", "50"]
    args += ["--policies", "lru,arc_admit", "--no-vllm", "--json", "--out", str(tmp_path / "o")]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"] == str(path) and len(report["results"]) == 4
    assert (tmp_path / "o" / "plot.png").stat().st_size > 0
    assert "Belady MIN" in (tmp_path / "o" / "table.md").read_text()


def test_cli_table_marks_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "offload", "--generate", "rag", "--requests", "80", "--capacity", "5%"]
    assert main([*args, "--no-vllm", "--policies", f"lru,{DEFAULT_CACHE_POLICY}"]) == 0
    out = capsys.readouterr().out
    assert "Belady" in out and "ceiling" in out and "(default)" in out


def test_vllm_rows_show_unavailable_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload_vllm, "unavailable", lambda: "vLLM unavailable (test)")
    report = bench(ids_trace([1, 2], [1, 2]), ["2"], ["lru"])
    assert report["vllm"] == "vLLM unavailable (test)"
    assert [r["policy"] for r in report["results"]] == ["lru"]  # type: ignore[union-attr]
