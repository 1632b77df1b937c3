"""``kvoffload bench offload --suite``: the held-out protocol (``offload_suite``).

vLLM's rows are stubbed (a fixed baseline per point), so these tests need no
vLLM and pin the suite's own logic: which traces, the deltas, the worst per
family, the leave-one-family-out choice, variants put back after use, the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.bench.policy import suite, suite_hybrid
from kvoffload.bench.policy import suite_cache as offload_suite_cache
from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.bench.policy.replay import Trace
from kvoffload.cli.main import main
from kvoffload.offload import DEFAULT_CACHE_POLICY


def point(family: str, **hits: float) -> suite.Point:
    """A point whose vLLM best is 10% and whose candidates hit ``hits`` (in %)."""
    pt = suite.Point(family, family, "1%", 10, 0.5, {"vllm:lru": 0.10})
    pt.hit.update({c: h / 100 for c, h in hits.items()})
    return pt


def test_deltas_and_the_worst_per_family() -> None:
    pts = [point("a", x=11, y=9.5), point("a", x=9, y=10), point("b", x=10.2, y=10.1)]
    assert pts[0].delta("x") == pytest.approx(1.0)
    worst = suite.worst_by_family(pts, ["x", "y"])
    assert worst["a"] == {"x": pytest.approx(-1.0), "y": pytest.approx(-0.5)}
    assert worst["b"] == {"x": pytest.approx(0.2), "y": pytest.approx(0.1)}


def test_leave_one_family_out_chooses_without_the_family_it_judges() -> None:
    # x is best on a and b, y on c: left out, c is judged with x (chosen on a and b),
    # and a and b with whichever is best on the rest.
    pts = [
        point("a", x=10.5, y=9.0, queue=10.0),
        point("b", x=10.4, y=9.5, queue=10.0),
        point("c", x=8.0, y=10.3, queue=10.0),
    ]
    table = {h.family: h for h in suite.leave_one_family_out(pts, ["x", "y", "queue"], "queue")}
    assert table["c"].chosen == "x"
    assert table["c"].held_out_worst == pytest.approx(-2.0)
    assert table["c"].in_sample_worst == pytest.approx(0.4)
    assert table["c"].best_worst == pytest.approx(0.3)
    assert table["c"].default_worst == pytest.approx(0.0)
    # Without a: x's worst on b, c is -2.0, y's -0.5, queue's 0.0: queue is chosen.
    assert table["a"].chosen == "queue"
    assert suite.leave_one_family_out(pts[:1], ["x"]) == []


def test_ties_go_to_the_higher_sum_then_the_first_listed() -> None:
    pts = [point("a", x=9, y=9, z=9), point("b", x=9, y=12, z=12), point("c", x=1, y=1, z=1)]
    table = {h.family: h for h in suite.leave_one_family_out(pts, ["x", "y", "z"], "x")}
    assert table["c"].chosen == "y"


def test_the_suite_holds_every_family_at_each_seed() -> None:
    traces = suite.suite_traces("quick", [])
    fams = [t.family for t in traces]
    assert list(dict.fromkeys(fams)) == list(suite.FAMILIES)
    assert all(fams.count(f) == len(suite.SIZES["quick"].seeds) for f in suite.FAMILIES)
    loop = next(t for t in traces if t.family == "loop")
    assert loop.capacities[-1] == "50%"
    # Same size, same traces: two runs differ only where the code does.
    again = suite.suite_traces("quick", [])
    assert [t.keys for t in again] == [t.keys for t in traces]
    with pytest.raises(ValueError, match="known: quick, full"):
        suite.suite_traces("huge", [])


def fake_vllm(trace: Trace, capacity: int) -> dict[str, float]:
    return {"vllm:lru": 0.05, "vllm:arc": 0.06, "vllm:lru+store_threshold=2": 0.04}


def tiny_traces() -> list[suite.SuiteTrace]:
    from kvoffload.bench.policy.traces import generate, trace_keys, trace_times

    out = []
    for fam in ("chat", "rag"):
        reqs = generate(fam, 80, 1)
        out.append(suite.SuiteTrace(fam, f"{fam}/1", trace_keys(reqs), trace_times(reqs), ("5%",)))
    return out


def test_variants_apply_only_during_their_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.offload.policies.default.arms_duel import ArmsDuel

    before = ArmsDuel.fresh_share
    seen: list[float] = []
    real_replay = suite.replay

    def spy(trace: Trace, policy: str, *args: object) -> object:
        seen.append(ArmsDuel.fresh_share)
        return real_replay(trace, policy, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(suite, "replay", spy)
    variants = suite.parse_variant("ArmsDuel.fresh_share=0.5")
    pts = suite.run_suite(tiny_traces(), ["lru"], variants, 0.0, None, fake_vllm)
    assert seen == [before, 0.5, before, 0.5]
    assert ArmsDuel.fresh_share == before
    assert [set(pt.hit) for pt in pts] == [{"lru", variants[0].name}] * 2
    assert pts[0].vllm_best == 0.06


@pytest.mark.parametrize(
    "spec",
    ["ArmsDuel.fresh_share", "NoSuchPolicy.x=1", "ArmsDuel.nope=1", "ArmsDuel.fresh_share=a"],
)
def test_a_bad_variant_is_one_clear_error(spec: str) -> None:
    with pytest.raises(ValueError, match="--vary"):
        suite.parse_variant(spec)


def test_an_unknown_policy_is_refused_before_any_replay() -> None:
    with pytest.raises(ValueError, match="known:"):
        suite.run_suite(tiny_traces(), ["nope"], (), 0.0, None, fake_vllm)


def test_without_vllm_the_suite_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload_vllm, "unavailable", lambda: "vLLM unavailable (test)")
    with pytest.raises(RuntimeError, match="vLLM unavailable"):
        suite.run_suite(tiny_traces(), ["lru"])


def small_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setenv(offload_suite_cache.CACHE_ENV, tempfile.mkdtemp() + "/rows.json")
    monkeypatch.setitem(suite.SIZES, "quick", suite.SuiteSize(60, (1,)))
    monkeypatch.setattr(offload_vllm, "unavailable", lambda: None)
    monkeypatch.setattr(suite, "vllm_hit_rates", fake_vllm)
    monkeypatch.setitem(suite_hybrid.SIZES, "quick", suite_hybrid.SIZES["tiny"])
    monkeypatch.setattr(suite_hybrid, "vllm_hit_rates", lambda *_: {"vllm:lru": 0.1})


def test_cli_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    small_suite(monkeypatch)
    args = ["bench", "offload", "--suite", "--policies", f"lru,{DEFAULT_CACHE_POLICY}", "--json"]
    assert main([*args, "--trace-file", write_trace(monkeypatch)]) == 0
    report = json.loads(capsys.readouterr().out)
    fams = [p["family"] for p in report["points"]]
    assert list(dict.fromkeys(fams)) == [*suite.FAMILIES, "real:t", "hybrid"]
    held = report["leave_one_family_out"]
    assert [h["family"] for h in held] == [*suite.FAMILIES, "real:t", "hybrid"]
    assert all(p["belady_hit_rate"] is None for p in report["points"] if p["family"] == "hybrid")
    assert set(report["worst_by_family"]["chat"]) == {"lru", DEFAULT_CACHE_POLICY}


def test_cli_tables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    small_suite(monkeypatch)
    monkeypatch.setattr(suite, "default_trace_files", lambda: [])
    assert main(["bench", "offload", "--suite", "--policies", "lru,arc"]) == 0
    out = capsys.readouterr().out
    titles = ("per family", "leave one family out", "chat/1 @ 5%", "loop/1 @ 50%")
    for title in (*titles, "hybrid/2g-w128/1 @ 20%"):
        assert title in out


def test_a_missing_trace_file_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    small_suite(monkeypatch)
    assert main(["bench", "offload", "--suite", "--trace-file", "/nonexistent/t.jsonl"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvoffload: error: --trace-file /nonexistent/t.jsonl: no such file"]


def write_trace(monkeypatch: pytest.MonkeyPatch) -> str:
    import tempfile

    from kvoffload.bench.policy.traces import generate, save_trace

    path = tempfile.mkdtemp() + "/t.jsonl"
    save_trace(generate("chat", 60, 9), path)
    return path


def test_vllm_rows_come_from_the_cache_file_when_every_part_of_the_key_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def compute(trace: Trace, capacity: int) -> dict[str, float]:
        calls.append(capacity)
        return {row: capacity / 100 for row in offload_vllm.ROWS}

    path = tmp_path / "c" / "rows.json"
    (a, b) = (t.keys for t in tiny_traces())
    cache = offload_suite_cache.VllmRowCache(path, compute)
    assert cache.rows(a, 5) == cache.rows(a, 5)  # the second from memory
    cache.rows(b, 5)
    cache.save()
    again = offload_suite_cache.VllmRowCache(path, compute)
    assert again.rows(a, 5)["vllm:lru"] == 0.05 and again.rows(b, 5)
    assert calls == [5, 5] and (again.hits, again.misses) == (2, 0)
    again.rows(a, 6)  # another size: a miss
    assert calls == [5, 5, 6]
    # Another vLLM version (or row set, or replay) never reuses an entry.
    monkeypatch.setattr(offload_suite_cache, "_vllm_version", lambda: "0.0.1")
    assert offload_suite_cache.VllmRowCache(path, compute).rows(a, 5)
    assert calls == [5, 5, 6, 5]


def test_an_unreadable_cache_file_is_a_clean_miss(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text("{not json")
    cache = offload_suite_cache.VllmRowCache(path, fake_vllm)
    assert cache.rows(tiny_traces()[0].keys, 5) == fake_vllm([], 5)
    assert cache.misses == 1
    cache.save()
    assert json.loads(path.read_text())["entries"]


def test_the_cli_reads_vllm_rows_from_the_cache_on_a_second_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    small_suite(monkeypatch)
    monkeypatch.setattr(suite, "default_trace_files", lambda: [])
    args = ["bench", "offload", "--suite", "--policies", "lru", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["vllm_rows_cached"] == 0
    # (The hybrid family's vLLM rows are replayed each run: not cached.)
    plain = [p for p in second["points"] if p["family"] != suite_hybrid.FAMILY]
    assert second["vllm_rows_cached"] == len(plain) < len(second["points"])
    assert second["points"] == first["points"]
    assert main([*args, "--no-vllm-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm_rows_cached"] == 0
