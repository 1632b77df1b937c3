"""``kvoffload run --events-endpoint ... --events-format vllm`` as a process, indexed by Dynamo.

The command itself runs (GPU, CPU and disk tiers, concurrency 1 and 8); Dynamo
and a copy-counting tracker (``stream.py``) read its stream. For
prompts built from the served chains, Dynamo's per-tier answers must equal
the tracker's: a stream that announced copies (vLLM's per-copy rule) would
leave Dynamo, which keeps one entry per hash, behind the tracker. The
engine-state comparison (not the stream's), replay after an indexer restart
and an engine restart are in ``test_dynamo_engine.py`` (the process here is
gone when the run ends, and with it its replay socket).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.bench.routing.indexer import DynamoIndexer, IndexerClient, TierOverlap
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.demo.serving import demo_workload
from kvoffload.engine.demo.workload import generate_trace
from kvoffload.engine.model_runner import peek_vocab_size
from tests.conftest_redis import free_port
from tests.router.conftest import register_when_bound
from tests.router.stream import StreamHoldings
from tests.router.test_dynamo_engine import BLOCK, MODEL, run_flags, wait_indexed
from tests.router.truth import Probe, probe_prompts

REQUESTS = 40


def differences(client: IndexerClient, tracker: StreamHoldings, probes: list[Probe]) -> list[str]:
    out = []
    for p in probes:
        want = tracker.overlap(p.token_ids, BLOCK)
        got = client.query(p.token_ids, MODEL).get(1, TierOverlap())
        if (got.gpu, got.cpu, got.disk) != (want.gpu, want.cpu, want.disk):
            out.append(f"{p.kind}: dynamo {(got.gpu, got.cpu, got.disk)}, stream {want}")
    return out


@pytest.mark.parametrize("concurrency", [1, 8])
def test_kvoffload_run_is_indexed_exactly(
    indexer: DynamoIndexer, tmp_path: Path, concurrency: int
) -> None:
    port, replay = free_port(), free_port()
    registrar = register_when_bound(indexer.client, 1, port, replay, MODEL, BLOCK)
    tracker = StreamHoldings(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    flags = run_flags(tmp_path / "disk", port, replay, concurrency)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvoffload.cli", "run", *flags, "--requests", str(REQUESTS)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        registrar.join(timeout=60)
        wait_indexed(indexer.client)
        tracker.settle()
        vocab = peek_vocab_size(EngineConfig())
        trace = list(generate_trace(demo_workload(vocab, REQUESTS, seed=0)))
        probes = probe_prompts([r.all_token_ids for r in trace], vocab, BLOCK, seed=concurrency)
        assert tracker.stores["gpu"] and tracker.stores["cpu"] and tracker.stores["disk"]
        bad = differences(indexer.client, tracker, probes)
        assert not bad, f"{len(bad)} of {len(probes)} prompts differ; first: {bad[:3]}"
        held_cpu = sum(tracker.overlap(p.token_ids, BLOCK).cpu > 0 for p in probes)
        assert held_cpu, "no prompt has a prefix in the CPU tier: the run shows nothing"
    finally:
        tracker.close()
