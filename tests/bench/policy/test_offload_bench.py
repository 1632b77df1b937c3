"""``kvoffload bench offload``: replay, Belady's bound, the ceiling, report and CLI."""

import json
from pathlib import Path

import pytest

from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.bench.policy.mooncake import MooncakeRequest, full_blocks
from kvoffload.bench.policy.offload import ORACLE_ROW, bench
from kvoffload.bench.policy.replay import (
    belady_hit_rate,
    ceiling_hit_rate,
    parse_capacity,
    replay,
    session_continues,
)
from kvoffload.bench.policy.traces import KINDS, generate, load_trace, save_trace, trace_keys
from kvoffload.cli.main import main
from kvoffload.offload import (
    DEFAULT_CACHE_POLICY,
    CPUOffloadingManager,
    make_offload_key,
)
from kvoffload.offload.policies import AdmitARCPolicy, AdmitLRUPolicy, CachePolicy, all_policies


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
        for p in all_policies():
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


@pytest.mark.parametrize("policy", [AdmitARCPolicy, AdmitLRUPolicy, DEFAULT_CACHE_POLICY])
def test_admission_beats_lru_on_a_scan_heavy_trace(policy: str | type[CachePolicy]) -> None:
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
    args += ["--policies", "lru,chain_arms", "--no-vllm", "--json", "--out", str(tmp_path / "o")]
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


def test_table_keeps_every_policy_name_whole_at_80_columns() -> None:
    # Four sizes and the long names once folded to "chain_…" for three different rows.
    from rich.console import Console

    from kvoffload.bench.policy.offload_report import print_report, table_lines

    trace = trace_keys(generate("chat", 120, seed=3))
    names = ["chain_arms", "arc", "lru", DEFAULT_CACHE_POLICY]
    report = bench(trace, ["1%", "5%", "10%", "25%"], names, with_vllm=False)
    report["trace"] = "trace.jsonl"
    console = Console(width=80, record=True)
    print_report(report, console)
    out = console.export_text()
    assert "…" not in out
    for name in names:
        assert f" {name} " in out
    # x vLLM lru is the lowest size's ratio: a target holds at every size or not at all.
    for row in report["results"]:  # type: ignore[union-attr]
        row["ops_vs_vllm_lru"] = 1.0 + row["capacity"] / 1000  # type: ignore[index]
    lines = {cells[0]: cells for cells in table_lines(report)}
    low = min(r["capacity"] for r in report["results"])  # type: ignore[union-attr]
    assert lines["lru"][-2] == f"{1.0 + low / 1000:.1f}x"


def test_each_timed_replay_starts_from_a_collected_frozen_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Full collections of earlier replays' objects fell inside later ones (one row at one
    # size 2.6x slower): each replay, ours and vLLM's, starts frozen; none stays frozen.
    import gc

    import kvoffload.bench.policy.offload as offload

    frozen: list[int] = []
    ours, theirs = offload.replay, offload_vllm.replay

    def spy_ours(*args: object, **kwargs: object) -> object:
        frozen.append(gc.get_freeze_count())
        return ours(*args, **kwargs)  # type: ignore[arg-type]

    def spy_theirs(*args: object, **kwargs: object) -> object:
        frozen.append(gc.get_freeze_count())
        return theirs(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(offload, "replay", spy_ours)
    monkeypatch.setattr(offload_vllm, "replay", spy_theirs)
    gc.unfreeze()
    trace = ids_trace([1, 2], [1, 2, 3], [1, 2])
    bench(trace, ["2", "3"], ["lru", "arc"])
    theirs_rows = 0 if offload_vllm.unavailable() else len(offload.VLLM_ROWS)
    assert len(frozen) == 2 * (2 + theirs_rows)
    assert all(n > 0 for n in frozen)
    assert gc.get_freeze_count() == 0


def test_vllm_rows_show_unavailable_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload_vllm, "unavailable", lambda: "vLLM unavailable (test)")
    report = bench(ids_trace([1, 2], [1, 2]), ["2"], ["lru"])
    assert report["vllm"] == "vLLM unavailable (test)"
    assert [r["policy"] for r in report["results"]] == ["lru"]  # type: ignore[union-attr]


def test_only_full_blocks_are_replayed() -> None:
    # 1,100 tokens: two full 512-token blocks; the third id is a partial block.
    reqs = [MooncakeRequest(0.0, 1100, 1, [1, 2, 3]), MooncakeRequest(1.0, 511, 1, [1])]
    assert trace_keys(reqs) == [ids_trace([1, 2])[0], []]
    report = bench(trace_keys(reqs), ["4"], ["lru"], with_vllm=False)
    assert report["blocks"] == 2 and report["full_blocks_only"] is True


def _queue_trace() -> tuple[list[list[bytes]], list[float]]:
    # A hot prefix read every 5th request amid one-off scans larger than the tier:
    # without hints LRU loses it; the queue announces it in time.
    reqs: list[list[int]] = []
    scan = 1000
    for i in range(100):
        if i % 5 == 0:
            reqs.append(list(range(8)))
        else:
            reqs.append(list(range(scan, scan + 6)))
            scan += 6
    return ids_trace(*reqs), [100.0 * i for i in range(len(reqs))]


def test_lookahead_hints_reach_the_policy_and_pay() -> None:
    trace, times = _queue_trace()
    without = replay(trace, "queue_arms", 12).hit_rate
    with_queue = replay(trace, "queue_arms", 12, times, lookahead_ms=1000.0)
    assert with_queue.hit_rate > without > replay(trace, "lru", 12).hit_rate
    assert with_queue.hit_rate <= belady_hit_rate(trace, 12) + 1e-12
    # A policy that ignores hints gives the same with and without them.
    assert replay(trace, "lru", 12, times, 1000.0).hit_rate == replay(trace, "lru", 12).hit_rate


def test_lookahead_announces_exactly_the_requests_within_the_window() -> None:
    from kvoffload.bench.policy import replay as replay_module

    calls: list[tuple[str, str]] = []

    class Spy(CPUOffloadingManager):
        def hint_queued(self, request_id: str, keys: object) -> None:
            calls.append(("q", request_id))

        def hint_dequeued(self, request_id: str) -> None:
            calls.append(("d", request_id))

    trace = ids_trace([1], [2], [3], [4])
    times = [0.0, 400.0, 900.0, 5000.0]
    orig = replay_module.CPUOffloadingManager
    replay_module.CPUOffloadingManager = Spy  # type: ignore[misc]
    try:
        replay(trace, "lru", 2, times, lookahead_ms=1000.0)
    finally:
        replay_module.CPUOffloadingManager = orig  # type: ignore[misc]
    assert calls == [
        ("q", "0"), ("q", "1"), ("q", "2"), ("d", "0"),
        ("d", "1"),
        ("d", "2"),
        ("q", "3"), ("d", "3"),
    ]  # fmt: skip


def test_bench_reports_the_lookahead_and_vllm_rows_ignore_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace, times = _queue_trace()
    report = bench(trace, ["12"], ["queue_arms"], False, None, times, 1.0)
    assert report["lookahead_s"] == 1.0
    with pytest.raises(ValueError, match="arrival time"):
        bench(trace, ["12"], ["lru"], False, None, None, 1.0)
    if offload_vllm.unavailable() is None:
        a = offload_vllm.replay(trace, "lru", 12)
        b = bench(trace, ["12"], ["lru"], True, None, times, 1.0)
        row = next(r for r in b["results"] if r["policy"] == "vllm:lru")  # type: ignore[union-attr]
        assert row["hit_blocks"] == a[0]


def test_loop_kind_is_a_round_robin_of_few_prompts() -> None:
    reqs = generate("loop", 32, seed=1)
    firsts = [r.hash_ids[0] for r in reqs]
    assert len(set(firsts)) == 8 and firsts[:8] == firsts[8:16]


def test_cli_lookahead_and_loop(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "offload", "--generate", "loop", "--requests", "64", "--no-vllm"]
    assert main([*args, "--policies", "lru,queue_arms", "--lookahead-s", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lookahead_s"] == 0.5 and "50%" in report["capacities"]
    assert main([*args, "--policies", "lru", "--capacity", "50%"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Full blocks only" in out and "No queue hints" in out


def test_conversation_kind_has_the_mooncake_conversation_shape() -> None:
    reqs = generate("conversation", 3000, seed=2)
    assert reqs == generate("conversation", 3000, seed=2)
    assert all(r.timestamp % 3000 == 0 for r in reqs)  # the trace's 3 s clock
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    assert {r.hash_ids[0] for r in reqs} == {reqs[0].hash_ids[0]}  # one system block
    # Each request ends in a partial block that no full-block replay offers.
    assert all(len(full_blocks(r, 512)) == len(r.hash_ids) - 1 for r in reqs)
    partials = [r.hash_ids[-1] for r in reqs]
    assert len(set(partials)) == len(reqs)
    # A minority continues an earlier session: its prompt starts with the whole of an
    # earlier full prompt longer than the system block.
    prompts: set[tuple[int, ...]] = set()
    continued = 0
    for r in reqs:
        full = tuple(full_blocks(r, 512))
        continued += any(full[:n] in prompts for n in range(2, len(full) + 1))
        prompts.add(full)
    assert 0.2 * len(reqs) < continued < 0.5 * len(reqs)


# -- the session-hint oracle row ------------------------------------------------------------


def test_session_continues_marks_requests_a_later_one_extends() -> None:
    # Ids are chained: a later request holding a request's last block holds all of it.
    trace = ids_trace([1, 2], [7], [1, 2, 3], [1], [1, 2, 3, 4], [7, 8], [])
    assert session_continues(trace) == [True, True, True, True, False, False, False]


def test_session_oracle_hints_reach_the_manager_once_each_request_is_served() -> None:
    from kvoffload.bench.policy import replay as replay_module

    calls: list[object] = []

    class Spy(CPUOffloadingManager):
        def lookup(self, keys: object) -> int:
            calls.append(("lookup", keys))
            return super().lookup(keys)  # type: ignore[arg-type]

        def hint_continues(self, keys: object) -> None:
            calls.append(("continues", keys))
            super().hint_continues(keys)  # type: ignore[arg-type]

    trace = ids_trace([1, 2], [9], [1, 2, 3])
    orig = replay_module.CPUOffloadingManager
    replay_module.CPUOffloadingManager = Spy  # type: ignore[misc]
    try:
        replay(trace, "queue_arms", 4, continues=session_continues(trace))
    finally:
        replay_module.CPUOffloadingManager = orig  # type: ignore[misc]
    assert calls == [
        ("lookup", trace[0]),
        ("continues", trace[0]),  # after request 0 is served, before request 1
        ("lookup", trace[1]),
        ("lookup", trace[2]),
    ]


def test_the_oracle_row_is_shown_but_never_the_policys_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = trace_keys(generate("conversation", 600, seed=3))
    report = bench(trace, ["2%"], [DEFAULT_CACHE_POLICY], False, session_oracle=True)
    rows = {r["policy"]: r for r in report["results"]}  # type: ignore[union-attr]
    assert set(rows) == {DEFAULT_CACHE_POLICY, ORACLE_ROW}
    summary = report["capacities"]["2%"]  # type: ignore[index]
    assert summary["best_policy"] == DEFAULT_CACHE_POLICY
    assert summary["default_hit_rate"] == rows[DEFAULT_CACHE_POLICY]["hit_rate"]
    # Telling the tier which conversations go on pays on a conversation trace.
    assert rows[ORACLE_ROW]["hit_rate"] > rows[DEFAULT_CACHE_POLICY]["hit_rate"]
    args = ["bench", "offload", "--generate", "conversation", "--requests", "300", "--no-vllm"]
    assert main([*args, "--policies", "lru", "--capacity", "5%", "--session-oracle"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "oracle from the trace's future" in out
