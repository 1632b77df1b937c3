"""End to end: greedy tokens are identical with offload off, eager and lazy.

The GPU tier is far too small for the prompts, so later requests find their
prefix evicted from the GPU and loaded back from the CPU tier; the outputs
must not change by a single token.
"""

import pytest

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.llm_engine import LLMEngine
from kvoffload.engine.request import SamplingParams

BS = 8


def prompts() -> list[list[int]]:
    system = [(7 * i + 3) % 500 for i in range(48)]
    convs = [[(11 * i + 37 * c + 1) % 500 for i in range(24)] for c in range(6)]
    out = []
    for turn in range(3):
        for c, conv in enumerate(convs):
            out.append(system + conv[: 8 * (turn + 1)] + [c, turn])
    return out


def run(store_mode: str, policy: str | None = None, **kw) -> tuple[list[list[int]], LLMEngine]:
    cfg = EngineConfig(
        block_size=BS,
        num_gpu_blocks=16,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        store_mode=store_mode,
        num_cpu_blocks=128,
        cache_policy=policy,
        **kw,
    )
    engine = LLMEngine(cfg)
    outs = []
    for p in prompts():  # one at a time, so the GPU tier churns between them
        outs += engine.generate([p], SamplingParams(max_tokens=6))
    engine.drain()
    return outs, engine


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    outs, engine = run("off")
    engine.close()
    return outs


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_identical_tokens_and_cpu_hits(reference, mode) -> None:
    outs, engine = run(mode)
    try:
        assert outs == reference
        assert engine.stats.tier_hit_tokens > 0, "the CPU tier never served a prefix"
        assert engine.connector is not None
        assert engine.connector.stats.blocks_loaded > 0
        assert_no_leaks(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve", "chain_lru"])
def test_identical_tokens_every_policy(reference, policy) -> None:
    outs, engine = run("eager", policy)
    try:
        assert outs == reference
        assert_no_leaks(engine)
    finally:
        engine.close()


def test_batched_and_preempted_generation_is_identical(reference) -> None:
    # Everything at once through a GPU tier so small that requests preempt each other.
    cfg = EngineConfig(
        block_size=BS,
        num_gpu_blocks=16,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        store_mode="eager",
        num_cpu_blocks=128,
    )
    engine = LLMEngine(cfg)
    try:
        outs = engine.generate(prompts(), SamplingParams(max_tokens=6))
        engine.drain()
        assert outs == reference
        assert engine.scheduler.num_preemptions > 0
        assert_no_leaks(engine)
    finally:
        engine.close()


def assert_no_leaks(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.connector is not None and engine.connector.num_in_flight_jobs() == 0
    pool = engine.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:]), "a GPU block ref survived"
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    mgr = engine.connector.manager
    assert mgr.num_evictable_blocks() + mgr.num_free_blocks() == mgr.num_blocks, "pinned slot"
