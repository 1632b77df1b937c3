"""kvoffload's disk and Redis tiers inside a real vLLM engine, vLLM's default multiprocess engine.

The CPU tier is 24 blocks, far below the round-robin working set (8 prefixes
of 10-19 blocks), so a revisited prefix has left the CPU tier and comes back
from disk / Redis. A restart (a new engine, its EngineCore and worker new
processes) with the same ``disk_dir`` and Redis serves the first engines'
prefixes on its very first requests, and a different model sharing both
directories gets nothing from them (the tiers are keyed by model identity).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.vllm.engine import TINY_BLOCK_BYTES, workload_phases
from tests.conftest_redis import RedisServer, find_server_binary, free_port
from tests.e2e_vllm.conftest import ENGINE_BASE, counter, outputs, run_job

pytestmark = pytest.mark.timeout(1800)

SMALL_CPU_BLOCKS = 24


@pytest.fixture(scope="module")
def lower_tier_run(
    engine_python: Path,
    tiny_model: Path,
    other_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    binary = find_server_binary()
    if binary is None:
        pytest.fail("no redis-server binary on PATH (.ci/run installs it)", pytrace=False)
    tmp = tmp_path_factory.mktemp("lower-tiers")
    server = RedisServer(binary, tmp).start()
    try:
        rr = workload_phases(("round_robin",))
        first_visits = [{"name": "first_visits", "prompts": rr[0]["prompts"][:8]}]
        small = SMALL_CPU_BLOCKS * TINY_BLOCK_BYTES
        disk = {"cpu_bytes": small, "disk_dir": str(tmp / "disk"), "disk_bytes": "256MiB"}
        redis = {"cpu_bytes": small, "redis_url": server.url}
        both = dict(disk, redis_url=server.url)
        base = dict(ENGINE_BASE, model=str(tiny_model), connector="kvoffload")
        events = {"endpoint": f"tcp://*:{free_port()}", "topic": "kv"}
        engines = [
            dict(base, name="disk", extra_config=disk, phases=rr, kv_events=events),
            dict(base, name="redis", extra_config=redis, phases=rr),
            dict(base, name="restart", extra_config=both, phases=first_visits),
            dict(base, name="other_model", model=str(other_model), extra_config=both,
                 phases=first_visits),
        ]  # fmt: skip
        return run_job(engine_python, engines)
    finally:
        server.kill()


@pytest.mark.parametrize("name", ["disk", "redis"])
def test_lower_tier_serves_what_the_cpu_tier_evicted(
    cpu_tier_run: dict[str, dict[str, Any]],
    lower_tier_run: dict[str, dict[str, Any]],
    name: str,
    record_property,
) -> None:
    engine = lower_tier_run[name]
    want, got = outputs(cpu_tier_run["none"])[:32], outputs(engine)
    same = sum(a == b for a, b in zip(want, got))
    hits = counter(engine, "external_prefix_cache_hits")
    prompt = counter(engine, "prompt_tokens")
    record_property("identical_outputs", f"{same}/{len(want)}")
    record_property("kvoffload_tokens", f"{hits}/{prompt}")
    print(f"{name}: {same}/{len(want)} identical, {hits} of {prompt} prompt tokens from kvoffload")
    print(f"engine starts (s): { {n: round(e['init_s']) for n, e in lower_tier_run.items()} }")
    assert same == len(want) == 32
    # A 24-block CPU tier cannot hold a round-robin revisit's prefix until its turn
    # comes again: most of the cached tokens came from below it.
    assert hits > prompt // 2


def test_restart_serves_the_first_engines_prefixes(
    cpu_tier_run: dict[str, dict[str, Any]],
    lower_tier_run: dict[str, dict[str, Any]],
    record_property,
) -> None:
    engine = lower_tier_run["restart"]
    want, got = outputs(cpu_tier_run["none"])[:8], outputs(engine)
    hits = counter(engine, "external_prefix_cache_hits")
    record_property("restart_tokens_from_lower_tiers", hits)
    print(f"restart: {hits} tokens of the first visits from disk/Redis")
    assert got == want
    # A new process starts with an empty CPU tier: every loaded token came from disk or Redis.
    assert hits > counter(engine, "prompt_tokens") // 2


def test_a_different_model_gets_none_of_them(
    lower_tier_run: dict[str, dict[str, Any]],
) -> None:
    engine = lower_tier_run["other_model"]
    assert counter(engine, "external_prefix_cache_hits") == 0
    assert counter(engine, "prompt_tokens") > 0


def test_engine_kv_events_show_the_storage_tier(
    lower_tier_run: dict[str, dict[str, Any]],
) -> None:
    events = lower_tier_run["disk"]["events"]
    print(f"engine KV events with a disk tier: {events}")
    assert not events["errors"]
    counts = events["counts"]
    assert counts.get("BlockStored:CPU", 0) > 0
    assert counts.get("BlockStored:STORAGE", 0) > 0
