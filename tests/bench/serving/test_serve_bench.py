"""``kvoffload bench serve`` (model workload) compares what differs.

Past problems: the default CPU tier held the whole working set, so every
policy gave identical results; the default policy was not marked; the printed
table did not fit 80 columns. The engine runs are replaced by a stand-in that
records the configurations (the real engine is exercised in
tests/cli/test_run_cmd.py); the pressure test replays the same workload's
blocks through the GPU pool and the CPU tier without a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import kvoffload.engine.demo.serving as serving
from kvoffload.bench.policy.mooncake import MooncakeRequest, replay_mooncake
from kvoffload.bench.serving import serve as serve_bench
from kvoffload.cli.main import main
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.demo.serving import ServeSummary, demo_workload
from kvoffload.engine.demo.workload import TraceHasher, generate_trace
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.offload.policies.registry import policy_names


def fake_summary(label: str, i: int) -> ServeSummary:
    return ServeSummary(
        label=label,
        requests=128,
        prompt_tokens=123_456_789,
        output_tokens=1_234_567,
        hit_rate_gpu=0.7123,
        hit_rate_cpu=0.0456 + i / 1000,
        hit_rate_lower=0.0,
        prefill_tokens_computed=10_234_567 - i,
        prefill_tokens_total=123_456_789,
        ttft_p50_s=0.123456,
        ttft_p99_s=1.234567,
        throughput_tok_s=123_456.7,
        wall_s=12.3,
        preemptions=3,
        blocks_stored=12_345,
        blocks_loaded=678,
    )


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    configs: list[EngineConfig] = []

    def fake_serve(config: EngineConfig, workload: Any, concurrency: int, label: str = "",
                   show_progress: bool = False) -> ServeSummary:  # fmt: skip
        configs.append(config)
        return fake_summary(label, len(configs))

    monkeypatch.setattr(serving, "serve", fake_serve)
    return configs


def test_default_cpu_tier_is_under_pressure(
    recorded: list[EngineConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    s = report["settings"]
    assert s["cpu_blocks"] == math.ceil(serve_bench.CPU_PRESSURE * s["unique_blocks"])
    assert s["cpu_blocks"] < s["unique_blocks"]  # the working set does not fit
    eager = [c for c in recorded if c.store_mode == "eager"]
    assert eager and all(c.num_cpu_blocks == s["cpu_blocks"] for c in eager)
    # every registered policy is compared, each exactly once
    assert sorted(c.cache_policy for c in eager) == sorted(policy_names())


def test_explicit_cpu_size_is_honoured(
    recorded: list[EngineConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--cpu-blocks", "77", "--policies", "lru", "--out", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["cpu_blocks"] == 77
    assert {c.num_cpu_blocks for c in recorded} == {77}


def test_policies_differ_at_the_default_pressure() -> None:
    """The default sizes make policies decide: their CPU-tier hit rates are not all equal."""
    wl = demo_workload(2048, 128, 0)
    hasher = TraceHasher(16)
    ids: dict[bytes, int] = {}
    reqs = []
    for i, r in enumerate(generate_trace(wl)):
        prompt, _ = hasher.hashes(r)
        reqs.append(MooncakeRequest(i, len(r.prompt_token_ids), 8,
                                    [ids.setdefault(h, len(ids)) for h in prompt]))  # fmt: skip
    unique = serve_bench.workload_unique_blocks(wl, 16)
    cpu = math.ceil(serve_bench.CPU_PRESSURE * unique)
    gpu = EngineConfig().num_gpu_blocks
    rates = {
        p: replay_mooncake(reqs, gpu, cpu, p, 8, block_size=16).hit_rate_cpu for p in policy_names()
    }
    assert len({round(r, 6) for r in rates.values()}) > 1, rates


def test_default_policy_is_marked_and_table_fits_80_columns(
    recorded: list[EngineConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines if not line.startswith("full table:")), [
        line for line in lines if len(line) > 80
    ]
    assert any(line.startswith(f"eager/{DEFAULT_CACHE_POLICY}*") for line in lines)
    assert f"* the default policy ({DEFAULT_CACHE_POLICY})" in out
    # no figure cut short ("10,2…"): the big numbers appear whole
    assert "10,234,566" in out and "…" not in out
    md = (tmp_path / "serve.md").read_text()
    header = md.splitlines()[0]
    for col in serve_bench.FULL_COLUMNS:
        assert col in header
    assert f"| eager/{DEFAULT_CACHE_POLICY}* |" in md
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_narrow_table_fits_with_long_labels() -> None:
    rows = [fake_summary("eager+disk+redis-with-a-long-name", 1), fake_summary("off", 2)]
    assert all(len(line) <= 80 for line in serve_bench.narrow_table(rows))


def test_unknown_policy_refused_before_any_run(
    recorded: list[EngineConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--policies", "lru,bogus"]) == 2
    assert recorded == []
    assert "bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mode", "modes"), [("off", {"off"}), ("lazy", {"off", "lazy"}), ("eager", {"off", "eager"})]
)
def test_store_mode_narrows_the_comparison(
    mode: str, modes: set[str], recorded: list[EngineConfig], tmp_path: Path
) -> None:
    argv = ["bench", "serve", "--store-mode", mode, "--policies", "lru", "--out", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    assert {c.store_mode for c in recorded} == modes
