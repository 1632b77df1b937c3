"""Dynamo's KV indexer, fed by the reference engine's events, agrees with the engine's tiers.

The engine is built from ``kvoffload run``'s own flags (GPU, CPU and disk
tiers, ``--events-format vllm``) and serves the built-in multi-turn workload at
concurrency 1 and 8. Then, for prompts built from what it served (held,
evicted, CPU-only, perturbed and random chains), Dynamo's per-tier overlap must
equal what each tier holds, read from the engine itself (``truth.py``). The same
again after the indexer restarts (it recovers through the replay socket) and
after the engine restarts on the same disk directory.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import pytest

from kvoffload.bench.routing.indexer import DynamoIndexer, IndexerClient, TierOverlap
from kvoffload.cli import run_cmd
from kvoffload.cli.engine_args import engine_config_from_args
from kvoffload.engine.demo.serving import demo_workload, run_trace
from kvoffload.engine.demo.workload import generate_trace
from kvoffload.engine.llm_engine import LLMEngine
from tests.conftest_redis import free_port
from tests.router.truth import Probe, classify, engine_overlap, probe_prompts

MODEL = "kvoffload-test"
BLOCK = 16
INSTANCE = 1


def run_flags(disk: Path, port: int, replay: int, concurrency: int) -> list[str]:
    """``kvoffload run``'s flags: tiers small enough that every one evicts."""
    return [
        "--block-size", str(BLOCK),
        "--gpu-blocks", "40",
        "--cpu-blocks", "64",
        "--disk-dir", str(disk),
        "--disk-blocks", "160",
        "--events-endpoint", f"tcp://127.0.0.1:{port}",
        "--events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
        "--events-format", "vllm",
        "--concurrency", str(concurrency),
    ]  # fmt: skip


def build_engine(flags: list[str]) -> tuple[LLMEngine, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    args = parser.parse_args(flags)
    return LLMEngine(engine_config_from_args(args)), args


def settle(engine: LLMEngine) -> None:
    """Every transfer finished and every event handed to the publisher's socket."""
    engine.drain()
    engine.step()  # an idle step publishes what the last transfers announced
    flush = getattr(engine.publisher, "flush", None)
    if flush is not None:
        flush()


def wait_indexed(client: IndexerClient, polls: int = 4, every_s: float = 0.25) -> None:
    """Until Dynamo's index stops changing (it applies events asynchronously)."""
    last, same = -1, 0
    for _ in range(200):
        dump = client.dump()
        n = sum(len(v.get("events", [])) for v in dump.values() if isinstance(v, dict))
        same = same + 1 if n == last else 0
        if same >= polls:
            return
        last = n
        time.sleep(every_s)


def register(client: IndexerClient, port: int, replay: int) -> None:
    client.register(INSTANCE, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", MODEL, BLOCK)


def mismatches(
    client: IndexerClient, engine: LLMEngine, probes: list[Probe]
) -> tuple[list[str], Counter[str]]:
    bad: list[str] = []
    kinds: Counter[str] = Counter()
    for p in probes:
        truth = engine_overlap(engine, p.token_ids)
        got = client.query(p.token_ids, MODEL).get(INSTANCE, TierOverlap())
        kinds[f"{p.kind}: {classify(truth)}"] += 1
        seen = (got.gpu, got.cpu, got.disk)
        want = (truth.gpu, truth.cpu, truth.disk)
        if seen != want:
            fields = "/".join(n for n, a, b in zip(("gpu", "cpu", "disk"), seen, want) if a != b)
            bad.append(
                f"{p.kind} ({classify(truth)}) {fields}: dynamo gpu/cpu/disk {seen}, tiers {want}"
            )
    return bad, kinds


def check(
    stage: str,
    client: IndexerClient,
    engine: LLMEngine,
    probes: list[Probe],
    indexer: DynamoIndexer,
) -> Counter[str]:
    wait_indexed(client)
    bad, kinds = mismatches(client, engine, probes)
    if bad:
        skipped = len(indexer.log_lines("skipping store"))
        dropped = len(indexer.log_lines("Block not published"))
        fields = Counter(b.split(") ")[1].split(":")[0] for b in bad)
        pytest.fail(
            f"{stage}: Dynamo's overlap differs from the tiers for {len(bad)} of "
            f"{len(probes)} prompts ({skipped} stores skipped for a missing parent, "
            f"{dropped} offloaded stores dropped; fields differing: {dict(fields)}); "
            f"first: {bad[:3]}; prompts: {dict(kinds)}",
            pytrace=False,
        )
    return kinds


def serve(engine: LLMEngine, concurrency: int, n: int, seed: int) -> list[Probe]:
    """Serve ``n`` turns of the demo workload; probes built from what was served."""
    vocab = engine.runner.vocab_size
    trace = list(generate_trace(demo_workload(vocab, n, seed=seed)))
    run_trace(engine, trace, concurrency)
    settle(engine)
    return probe_prompts([r.all_token_ids for r in trace], vocab, BLOCK, seed=seed)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_dynamo_overlap_equals_tier_holdings(
    indexer: DynamoIndexer, tmp_path: Path, concurrency: int
) -> None:
    port, replay = free_port(), free_port()
    engine, args = build_engine(run_flags(tmp_path / "disk", port, replay, concurrency))
    client = indexer.client
    try:
        register(client, port, replay)
        probes = serve(engine, args.concurrency, 40, seed=3)
        kinds = check("after serving", client, engine, probes, indexer)
        # The probes exercise every tier: a prefix held on the GPU, one that
        # goes on in the CPU tier, one that goes on on disk, and one evicted from all.
        classes = {k.split(": ")[1] for k in kinds}
        assert {"GPU", "beyond CPU on disk", "none held"} <= classes, kinds
        assert classes & {"CPU beyond GPU", "CPU only"}, kinds

        # Dynamo asks the replay socket for what it missed when the first live
        # batch shows a gap ("expected seq 0, got N"): an instance that publishes
        # nothing after the indexer's restart stays unindexed until it does.
        indexer.restart()
        register(client, port, replay)
        time.sleep(0.5)  # its subscription connects before the next live batch
        probes += serve(engine, args.concurrency, 6, seed=5)
        check("after the indexer restarted (replay)", client, engine, probes, indexer)
    finally:
        engine.close()


@pytest.mark.parametrize("concurrency", [1, 8])
def test_dynamo_overlap_after_engine_restart(
    indexer: DynamoIndexer, tmp_path: Path, concurrency: int
) -> None:
    port, replay = free_port(), free_port()
    flags = run_flags(tmp_path / "disk", port, replay, concurrency)
    engine, args = build_engine(flags)
    client = indexer.client
    try:
        register(client, port, replay)
        probes = serve(engine, args.concurrency, 40, seed=3)
    finally:
        engine.close()
    # A new engine process on the same disk directory and event endpoints: the
    # GPU and CPU tiers start empty, the disk tier keeps what it held.
    engine, args = build_engine(flags)
    try:
        time.sleep(0.5)  # the indexer's subscription reconnects to the new publisher
        probes += serve(engine, args.concurrency, 12, seed=4)
        check("after the engine restarted on the same disk", client, engine, probes, indexer)
    finally:
        engine.close()
