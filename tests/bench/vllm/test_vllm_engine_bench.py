"""The driver side of ``kvoffload bench vllm`` and tests/e2e_vllm: workloads, summaries, lookup.

The engine itself runs in tests/e2e_vllm; nothing here needs vLLM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvoffload.bench.vllm import driver
from kvoffload.bench.vllm import engine as vllm_engine
from kvoffload.bench.vllm.driver import find_engine_python, work_units
from kvoffload.bench.vllm.engine import (
    batch_rounds,
    round_robin_prompts,
    summarize,
    workload_phases,
)
from kvoffload.bench.vllm.model import FIRST_WORD_ID, VOCAB_SIZE


def test_round_robin_visits_eight_prefixes_four_times() -> None:
    prompts = round_robin_prompts()
    assert len(prompts) == 32
    prefixes = [p[:-8] for p in prompts]
    assert prefixes[:8] == prefixes[8:16] == prefixes[24:32]
    assert len({tuple(p) for p in prefixes}) == 8
    assert all(300 <= len(p) <= 600 for p in prefixes)
    assert len({tuple(p) for p in prompts}) == 32  # every visit has its own suffix
    assert all(FIRST_WORD_ID <= t < VOCAB_SIZE for p in prompts for t in p)
    assert round_robin_prompts() == prompts  # deterministic


def test_batch_rounds_alternate_two_prefix_sets() -> None:
    rounds = batch_rounds()
    assert [len(r) for r in rounds] == [4, 4, 4, 4]
    assert [p[:-8] for p in rounds[0]] == [p[:-8] for p in rounds[2]]
    assert [p[:-8] for p in rounds[1]] == [p[:-8] for p in rounds[3]]
    assert rounds[0][0][:-8] != rounds[1][0][:-8]
    # Four concurrent requests fit the 48-block device tier of 32-token blocks.
    assert all(sum(len(p) for p in r) <= 48 * 32 - 4 * 64 for r in rounds)


def test_phases_and_work_units() -> None:
    phases = workload_phases(("round_robin", "batch"), max_tokens=4)
    assert [p["name"] for p in phases] == ["round_robin", "batch0", "batch1", "batch2", "batch3"]
    assert all(p["max_tokens"] == 4 for p in phases)
    assert [bool(p.get("concurrent")) for p in phases] == [False, True, True, True, True]
    assert work_units([{"phases": phases}, {"phases": phases[:1]}]) == (1 + 48) + (1 + 32)
    with pytest.raises(ValueError, match="unknown workload"):
        workload_phases(("nope",))


def test_summarize_reads_vllm_counters_and_ttft() -> None:
    engine = {
        "init_s": 3.0,
        "phases": [
            {
                "wall_s": 2.0,
                "counters": {
                    "prompt_tokens": 1000,
                    "prefix_cache_hits": 64,
                    "external_prefix_cache_hits": 640,
                },
                "requests": [
                    {"tokens": [1, 2], "num_cached_tokens": 0, "ttft_s": t} for t in (0.1, 0.3)
                ],
            }
        ],
    }
    s = summarize(engine)
    assert s["kvoffload_cached_tokens"] == 640
    assert s["device_cached_tokens"] == 64
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["ttft_p99_ms"] == pytest.approx(300.0)
    assert s["prompt_tokens_per_s"] == pytest.approx(500.0)
    assert s["output_tokens_per_s"] == pytest.approx(2.0)


def test_engine_python_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(driver.ENGINE_PYTHON_ENV, str(fake))
    assert find_engine_python() == fake
    assert find_engine_python(str(fake)) == fake
    monkeypatch.setenv(driver.ENGINE_PYTHON_ENV, str(tmp_path / "missing"))
    monkeypatch.setattr(driver, "REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    assert find_engine_python() is None
    # A venv whose Python exists but without vLLM yet (an install in progress) is no engine.
    venv = tmp_path / driver.ENGINE_VENV
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)
    assert find_engine_python() is None
    site = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    assert find_engine_python() == venv / "bin" / "python"


def test_engine_env_keeps_a_shared_machine_usable() -> None:
    env = driver.engine_env({"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert str(driver.REPO_ROOT) in env["PYTHONPATH"].split(":")
    # A user's own settings win.
    assert driver.engine_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_bench_without_an_engine_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(driver.ENGINE_PYTHON_ENV, raising=False)
    monkeypatch.setattr(driver, "REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    vllm_engine.add_arguments(parser)
    args = parser.parse_args([])
    with pytest.raises(FileNotFoundError, match="make engine"):
        vllm_engine.bench(args)
