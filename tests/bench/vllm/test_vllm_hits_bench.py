"""The driver side of ``kvoffload bench vllm --hits`` (issue 31's table); no vLLM needed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvoffload.bench.vllm.hits import (
    PROFILED,
    STAGE_ENV,
    SUFFIX,
    engine_specs,
    hit_prompts,
    profile_summary,
    ratio_interval,
    summarize,
)


def test_prompts_revisit_the_same_prefixes_with_new_suffixes() -> None:
    rounds = hit_prompts(visits=3)
    assert [len(r) for r in rounds] == [8, 8, 8]
    prefixes = [[p[:-SUFFIX] for p in r] for r in rounds]
    assert prefixes[0] == prefixes[1] == prefixes[2]
    assert all(1024 <= len(p) <= 1984 for p in prefixes[0])
    assert rounds[0][0][-SUFFIX:] != rounds[1][0][-SUFFIX:]
    assert hit_prompts(visits=3) == rounds


def test_engines_same_prompts_device_cache_sizes(tmp_path: Path) -> None:
    rounds = hit_prompts(visits=2)
    engines = {e["name"]: e for e in engine_specs("m", rounds, 8192, tmp_path)}
    assert list(engines) == [
        "miss",
        "device",
        "kvoffload",
        "kvoffload_whole",
        "kvoffload_async",
        "device_kvoffload",
    ]
    assert engines["kvoffload_whole"]["env"][STAGE_ENV] == "0"  # never staged
    assert STAGE_ENV not in engines["kvoffload"]["env"]  # the default
    assert engines["miss"]["enable_prefix_caching"] is False
    longest = max(len(p) for p in rounds[0])
    # The offload rows' device cache holds the longest request but far from every
    # prefix (round-robin over 8: LRU has evicted a prefix before its revisit); the
    # device row's holds every prefix.
    one = engines["kvoffload"]["num_gpu_blocks"]
    assert longest <= one * 32 < sum(len(p) for p in rounds[0]) / 3
    assert engines["device"]["num_gpu_blocks"] * 32 >= sum(len(p) for p in rounds[0])
    assert engines["kvoffload"]["connector"] == PROFILED
    assert "sync_load_budget_bytes" not in engines["kvoffload"]["extra_config"]  # the default
    assert engines["kvoffload_async"]["extra_config"]["sync_load_budget_bytes"] == 0
    assert engines["kvoffload"]["extra_config"]["cpu_bytes"] >= 8192 * sum(
        len(p) for p in rounds[0]
    )
    assert engines["device_kvoffload"]["num_gpu_blocks"] == engines["device"]["num_gpu_blocks"]
    assert engines["device_kvoffload"]["connector"] == PROFILED
    for name in ("device", "kvoffload", "kvoffload_whole", "kvoffload_async", "device_kvoffload"):
        assert [p["prompts"] for p in engines[name]["phases"]] == rounds
    assert engines["miss"]["phases"][0]["prompts"] == rounds[1]
    assert engines["miss"]["phases"][1]["prompts"] == [p[-SUFFIX:] for p in rounds[1]]


PROFILE = [
    {
        "kind": "hit",
        "steps_waited": 0,
        "wait_s": 5e-4,
        "lookup_s": 1e-4,
        "alloc_s": 2e-4,
        "sync": True,
    },
    {
        "kind": "hit",
        "steps_waited": 2,
        "wait_s": 7.5e-3,
        "lookup_s": 3e-4,
        "alloc_s": 2e-4,
        "sync": False,
    },
    {"kind": "load_step", "start_s": 2e-3, "load_bytes": 10**7},
    {"kind": "load_step", "start_s": 1e-4, "load_bytes": 10**7},
    {"kind": "load_done", "bytes": 10**7, "seconds": 1e-3},
    {"kind": "load_done", "bytes": 10**7, "seconds": 1e-3},
    {"kind": "bulk", "bytes": 10**7, "seconds": 5e-4, "hot_seconds": 2.5e-4},
    {"kind": "sched_step", "meta_s": 1e-4},
    {"kind": "worker_step", "finished_s": 4e-4, "meta_s": 0.0},
    {"kind": "forward_waits", "layer_s": 3e-4, "save_s": 1e-4},
]


def test_profile_summary_per_hit_means_and_gbps() -> None:
    s = profile_summary(PROFILE)
    assert (s["hits"], s["sync_hits"]) == (2, 1)
    assert s["steps_waited_mean"] == 1.0 and s["steps_waited_max"] == 2
    assert s["wait_ms_mean"] == pytest.approx(4.0)
    assert s["load_gbps"] == pytest.approx(10.0)
    assert s["bulk_gbps"] == pytest.approx(20.0)
    assert s["bulk_hot_gbps"] == pytest.approx(40.0)
    assert s["load_vs_bulk"] == pytest.approx(0.5)
    b = s["breakdown_ms"]
    assert b["scheduler lookup"] == pytest.approx(0.2)
    assert b["worker start_load_kv (submit + sync wait)"] == pytest.approx(1.05)
    assert b["  of which the copy (may run under the forward pass)"] == pytest.approx(1.0)
    assert b["forward pass waiting for a layer's copy"] == pytest.approx(0.15)
    # Blocking: 2.1 ms of submission and waits before the forward pass, 0.4 ms in it.
    assert s["blocking_ms"] == pytest.approx(1.25)
    assert s["blocking_gbps"] == pytest.approx(2 * 10**7 / 2.5e-3 / 1e9)
    assert profile_summary([])["hits"] == 0


def _engine(name: str, ttft: dict[str, float], tokens: list[int] | None = None) -> dict:
    return {
        "name": name,
        "phases": [
            {
                "name": phase,
                "requests": [{"ttft_s": t / 1e3, "tokens": tokens or [1, 2]}],
                "counters": {"prompt_tokens": 100, "prefix_cache_hits": 64},
            }
            for phase, t in ttft.items()
        ],
        "hit_profile": PROFILE,
    }


def test_summarize_ratios_gap_and_outputs() -> None:
    result = {
        "engines": [
            _engine("miss", {"miss": 500.0, "suffix": 15.0}),
            _engine("device", {"visit0": 500.0, "visit1": 20.0}),
            _engine("kvoffload", {"visit0": 500.0, "visit1": 22.0}),
            _engine("kvoffload_whole", {"visit0": 500.0, "visit1": 23.0}),
            _engine("kvoffload_async", {"visit0": 500.0, "visit1": 30.0}, tokens=[9]),
            _engine("device_kvoffload", {"visit0": 500.0, "visit1": 21.0}),
        ]
    }
    s = summarize(result)
    rows = s["rows"]
    assert rows["kvoffload hit"]["x_device_hit"] == pytest.approx(1.1)
    assert rows["kvoffload hit"]["gap_closed"] == pytest.approx(478 / 480)
    assert rows["miss"]["gap_closed"] == 0.0
    assert rows["suffix alone"]["ttft_mean_ms"] == 15.0
    assert rows["kvoffload hit"]["profile"]["hits"] == 2
    assert s["identical_outputs"] == {
        "miss": 1,
        "kvoffload hit": 1,
        "kvoffload hit, whole loads": 1,
        "kvoffload hit, async loads": 0,
        "device hit, kvoffload on": 1,
    }
    assert rows["device hit, kvoffload on"]["x_device_hit"] == pytest.approx(1.05)
    # One pair of revisits: the interval is the ratio itself.
    assert rows["kvoffload hit"]["x_device_hit_95"] == pytest.approx((1.1, 1.1))
    assert rows["kvoffload hit, async loads"]["x_device_hit_95"] == pytest.approx((1.5, 1.5))
    assert "x_device_hit_95" not in rows["miss"]  # other prompts: nothing to pair


def test_ratio_interval_pairs_requests_by_prompt() -> None:
    # Prompts of very different lengths, each 10% slower on the second engine give or
    # take 1%: paired, the spread of the prompts cancels and the interval is narrow.
    rng = random.Random(1)
    base = [rng.uniform(10, 60) for _ in range(40)]
    row = [b * 1.1 * rng.uniform(0.99, 1.01) for b in base]
    lo, hi = ratio_interval(row, base)
    point = sum(row) / sum(base)
    assert lo <= point <= hi
    assert lo > 1.09 and hi < 1.11
    # The same numbers unpaired (the second engine's shuffled) spread far wider.
    shuffled = rng.sample(row, len(row))
    lo2, hi2 = ratio_interval(shuffled, base)
    assert hi2 - lo2 > 3 * (hi - lo)
    assert ratio_interval(row, base) == (lo, hi)  # seeded: the same table twice
    with pytest.raises(ValueError, match="paired samples"):
        ratio_interval(row[:-1], base)
