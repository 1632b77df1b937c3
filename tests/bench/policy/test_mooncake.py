"""Mooncake replay and ``kvoffload bench serve --mooncake``: each past untruth has a test.

Past problems: prompts silently cut to ``gpu_blocks - 1``; ``--policy``,
``--cpu-bytes``, ``--store-mode off``, ``--disk-dir``, ``--redis-url``,
``--out``, ``--block-size`` ignored; refused stores dropped in silence; no
settings or reference figures in the JSON; toy default tier sizes; GPU-hit
blocks never offered to the CPU tier; a full GPU hit not touching it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.policy.mooncake import (
    MooncakeRequest,
    full_blocks,
    longest_request,
    read_mooncake_trace,
    replay_mooncake,
    unique_blocks,
)
from kvoffload.cli.main import main
from kvoffload.offload import CPUOffloadingManager


def write_trace(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def shared_prefix_trace(n: int = 60) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        conv = i % 6
        turn = i // 6
        ids = [1000 + k for k in range(4)] + [conv * 100 + k for k in range(2 + turn)]
        rows.append(
            {
                "timestamp": i * 10,
                "input_length": 512 * len(ids),
                "output_length": 32,
                "hash_ids": ids,
            }
        )
    return rows


def req(ts: float, ids: list[int]) -> MooncakeRequest:
    return MooncakeRequest(ts, 512 * len(ids), 8, ids)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["bench", "serve", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def _outputs_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `bench serve` writes its table and plot to ./bench-serve unless given --out.
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    p = tmp_path / "t.jsonl"
    write_trace(p, shared_prefix_trace())
    return p


def test_read_trace_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    write_trace(p, shared_prefix_trace(3))
    reqs = list(read_mooncake_trace(p))
    assert len(reqs) == 3 and reqs[0].hash_ids[:4] == [1000, 1001, 1002, 1003]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        list(read_mooncake_trace(bad))


def test_cpu_tier_adds_hits_beyond_a_small_gpu_tier(trace: Path) -> None:
    reqs = list(read_mooncake_trace(trace))
    gpu_only = replay_mooncake(reqs, num_gpu_blocks=16, num_cpu_blocks=None, hold_requests=1)
    with_cpu = replay_mooncake(reqs, num_gpu_blocks=16, num_cpu_blocks=200, hold_requests=1)
    assert with_cpu.hit_rate_cpu > 0
    assert with_cpu.hit_rate_gpu + with_cpu.hit_rate_cpu > gpu_only.hit_rate_gpu
    big = replay_mooncake(reqs, num_gpu_blocks=10_000, num_cpu_blocks=None)
    assert big.hit_rate_gpu >= with_cpu.hit_rate_gpu + with_cpu.hit_rate_cpu - 1e-9


# -- no silent truncation --------------------------------------------------------------------


def test_a_request_longer_than_the_gpu_tier_is_refused_not_truncated() -> None:
    reqs = [req(0, list(range(20)))]
    with pytest.raises(ValueError, match=r"20 blocks.*--gpu-blocks >= 21"):
        replay_mooncake(reqs, num_gpu_blocks=16, num_cpu_blocks=100)
    res = replay_mooncake(reqs, num_gpu_blocks=21, num_cpu_blocks=100)
    assert res.blocks == 20  # every block counted


def test_cli_refuses_a_too_small_gpu_tier(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--mooncake", str(trace), "--gpu-blocks", "4"]) == 2
    assert "--gpu-blocks >=" in capsys.readouterr().err


def test_default_tiers_are_sized_from_the_trace(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(capsys, "--mooncake", str(trace), "--out", str(tmp_path / "o"))
    s = out["settings"]
    longest = max(len(r["hash_ids"]) for r in shared_prefix_trace())
    total_blocks = sum(len(r["hash_ids"]) for r in shared_prefix_trace())
    assert s["gpu_blocks"] >= longest + 1 and s["gpu_blocks_from"] == "trace"
    assert s["cpu_blocks"] == -(-s["unique_blocks"] // 10)
    for row in out["results"].values():
        assert row["blocks"] == total_blocks  # nothing cut


# -- every flag honoured or refused ----------------------------------------------------------


@pytest.mark.parametrize(
    "flag",
    [
        ["--cpu-bytes", "1GiB"],
        ["--disk-dir", "DIR"],
        ["--redis-url", "redis://127.0.0.1:6379/0"],
        ["--model", "DIR"],
        ["--seed", "3"],
        ["--kv-layout", "kv_split"],
        ["--hash-fn", "sha256_cbor"],
        ["--write-through"],
        ["--disk-blocks", "10"],
        ["--events-endpoint", "tcp://127.0.0.1:1"],
        ["--max-num-seqs", "4"],
        ["--max-num-batched-tokens", "64"],
    ],
)
def test_unsupported_flags_are_refused(
    flag: list[str], trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = [str(tmp_path) if f == "DIR" else f for f in flag]
    assert main(["bench", "serve", "--mooncake", str(trace), *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert flag[0] in err and "not supported with --mooncake" in err


def test_policy_is_honoured_and_marked(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--mooncake", str(trace), "--policies", "lru", "--policy", "arc")
    assert set(out["results"]) == {"gpu-only", "cpu/arc*", "cpu/lru"}
    assert out["settings"]["default_policy"] == "arc"
    assert main(["bench", "serve", "--mooncake", str(trace), "--policy", "bogus"]) == 2
    assert "unknown cache policy 'bogus'" in capsys.readouterr().err


def test_store_mode_off_reports_no_cpu_hits(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(capsys, "--mooncake", str(trace), "--store-mode", "off")
    assert list(out["results"]) == ["gpu-only"]
    assert out["results"]["gpu-only"]["hit_rate_cpu"] == 0
    assert out["settings"]["store_mode"] == "off"
    reqs = list(read_mooncake_trace(trace))
    res = replay_mooncake(reqs, 16, 200, "lru", 1, store_mode="off")
    assert res.cpu_hit_blocks == 0 and res.blocks_offered == 0


def test_lazy_store_mode_differs_from_eager(trace: Path) -> None:
    reqs = list(read_mooncake_trace(trace))
    eager = replay_mooncake(reqs, 16, 200, "lru", 1, "eager")
    lazy = replay_mooncake(reqs, 16, 200, "lru", 1, "lazy")
    assert lazy.cpu_hit_blocks > 0
    assert lazy.blocks_offered != eager.blocks_offered


def test_out_dir_is_written(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "report"
    out = run_json(capsys, "--mooncake", str(trace), "--out", str(out_dir), "--policies", "lru")
    saved = json.loads((out_dir / "mooncake.json").read_text())
    assert saved["results"] == out["results"]
    assert "cpu/lru" in (out_dir / "mooncake.md").read_text()


def test_block_size_is_checked_against_the_trace(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--mooncake", str(trace), "--block-size", "16"]) == 2
    assert "--block-size 16 does not match the trace" in capsys.readouterr().err
    out = run_json(capsys, "--mooncake", str(trace), "--block-size", "512", "--out", str(tmp_path))
    assert out["settings"]["block_size"] == 512


def test_a_trace_of_another_block_size_is_replayed_at_that_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 16-token ids, each request ending in a partial block: at 512 tokens per block
    # (the default) every request would have zero full blocks.
    rows = [
        {"timestamp": i, "input_length": 16 * 5 + 3, "output_length": 4, "hash_ids": ids}
        for i, ids in enumerate([[1, 2, 3, 4, 5, 90 + i] for i in range(12)])
    ]
    p = tmp_path / "t16.jsonl"
    write_trace(p, rows)
    out = run_json(capsys, "--mooncake", str(p), "--block-size", "16", "--out", str(tmp_path))
    s = out["settings"]
    assert s["block_size"] == 16
    assert s["unique_blocks"] == 5 and s["longest_request_blocks"] == 5
    for row in out["results"].values():
        assert row["blocks"] == 5 * len(rows)  # full blocks at 16 tokens, partial ones left out
    assert out["reference"]["ceiling_hit_rate"] == pytest.approx(1 - 5 / (5 * len(rows)))


def test_requests_and_concurrency_are_honoured(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(
        capsys,
        "--mooncake",
        str(trace),
        "--requests",
        "7",
        "--concurrency",
        "3",
        "--out",
        str(tmp_path),
    )
    assert out["settings"]["requests"] == 7 and out["settings"]["hold_requests"] == 3
    assert out["results"]["gpu-only"]["requests"] == 7


# -- refused stores, reference figures -------------------------------------------------------


def test_refused_stores_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [req(i, [i * 10 + k for k in range(4)]) for i in range(5)]
    monkeypatch.setattr(CPUOffloadingManager, "prepare_store", lambda self, keys: None)
    res = replay_mooncake(reqs, 8, 4, "lru", 1)
    assert res.stores_refused == res.blocks_offered == 20
    assert res.blocks_stored == 0


def test_json_has_settings_reference_and_timing(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(capsys, "--mooncake", str(trace), "--cpu-blocks", "30", "--out", str(tmp_path))
    s = out["settings"]
    for key in ("trace", "requests", "unique_blocks", "block_size", "gpu_blocks", "cpu_blocks",
                "store_mode", "policies", "default_policy", "hold_requests"):  # fmt: skip
        assert key in s
    assert s["cpu_blocks"] == 30 and s["cpu_blocks_from"] == "flag"
    ref = out["reference"]
    assert 0 < ref["belady_hit_rate_cpu"] <= ref["belady_hit_rate_gpu_plus_cpu"]
    assert ref["belady_hit_rate_gpu_plus_cpu"] <= ref["ceiling_hit_rate"] + 1e-12
    assert out["run_s"] > 0
    for row in out["results"].values():
        assert "ops_per_s" in row and "stores_refused" in row and "seconds" in row
        assert row["hit_rate_total"] <= ref["ceiling_hit_rate"] + 1e-12


# -- GPU hits reach the CPU tier -------------------------------------------------------------


def test_gpu_hit_blocks_are_offered_to_the_cpu_tier() -> None:
    # Request 1 is computed; request 2 hits all of it in the GPU tier and adds one block.
    # The CPU tier first refuses everything, then has room: request 2's GPU-hit blocks
    # must still reach it (vLLM offers a request's blocks whatever tier they came from).
    reqs = [req(0, [1, 2, 3]), req(1, [1, 2, 3, 4])]
    calls: list[int] = []
    orig = CPUOffloadingManager.prepare_store

    def flaky(self: CPUOffloadingManager, keys: list[bytes]) -> Any:
        calls.append(len(keys))
        return None if len(calls) == 1 else orig(self, keys)

    mp = pytest.MonkeyPatch()
    mp.setattr(CPUOffloadingManager, "prepare_store", flaky)
    try:
        res = replay_mooncake(reqs, 16, 10, "lru", 4)
    finally:
        mp.undo()
    assert calls == [3, 4]
    assert res.blocks_stored == 4 and res.stores_refused == 3


def test_a_full_gpu_hit_touches_the_cpu_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    touched: list[int] = []
    orig = CPUOffloadingManager.touch

    def spy(self: CPUOffloadingManager, keys: list[bytes]) -> None:
        touched.append(len(keys))
        orig(self, keys)

    monkeypatch.setattr(CPUOffloadingManager, "touch", spy)
    res = replay_mooncake([req(0, [1, 2, 3]), req(1, [1, 2, 3])], 16, 10, "lru", 4)
    assert res.gpu_hit_blocks == 3  # the second request is a full GPU hit ...
    assert touched == [3, 3]  # ... and still touches its blocks in the CPU tier


def test_text_output_fits_80_columns(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--mooncake", str(trace), "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if not line.startswith("report:")]
    assert table and all(len(line) <= 80 for line in table)


def test_only_full_blocks_are_replayed() -> None:
    # 1,100 tokens in 512-token blocks: two full blocks, the third id a partial block
    # (an engine never hashes it); a 300-token request offers no block at all.
    reqs = [MooncakeRequest(0.0, 1100, 8, [1, 2, 3]), MooncakeRequest(1.0, 300, 8, [9])]
    assert full_blocks(reqs[0]) == [1, 2] and full_blocks(reqs[1]) == []
    assert longest_request(reqs) == 2 and unique_blocks(reqs) == 2
    res = replay_mooncake([*reqs, MooncakeRequest(2.0, 1100, 8, [1, 2, 3])], 8, 8)
    assert res.blocks == 4 and res.gpu_hit_blocks + res.cpu_hit_blocks == 2
