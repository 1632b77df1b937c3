"""A long-lived engine keeps bounded memory: per-request statistics are aggregated.

2,000+ tiny requests through an engine with CPU offload; after a warm-up the
number of live Python objects (gc-tracked) must stay flat.
"""

import gc

import pytest

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams
from kvoffload.engine.stats import LatencyWindow

BS = 4


def serve(engine: LLMEngine, start: int, n: int) -> None:
    params = SamplingParams(max_tokens=1)
    for i in range(start, start + n):
        # Shared 8-token prefix + 2 unique tokens: hits, stores and evictions all happen.
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, i % 500, (i // 500) % 500], params)
        if i % 8 == 7:
            while engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.drain()


def live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_retained_objects_stay_flat_over_2000_requests() -> None:
    engine = LLMEngine(
        EngineConfig(
            block_size=BS,
            num_gpu_blocks=24,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            num_cpu_blocks=32,
        )
    )
    try:
        serve(engine, 0, 400)  # warm-up: caches, tiers and windows fill
        before = live_objects()
        serve(engine, 400, 1800)
        after = live_objects()
        assert engine.stats.finished_requests == 2200
        # A leak of one object per request would add 1,800; allow small noise.
        assert after - before < 200, f"{after - before} more live objects after 1,800 requests"
        assert engine.stats.ttft_s.count == 2200
        assert engine.stats.ttft_s.percentile(50) > 0
    finally:
        engine.close()


def test_latency_window_is_bounded_and_exact_on_its_window() -> None:
    w = LatencyWindow(window=4)
    for v in (10.0, 1.0, 2.0, 3.0, 4.0):
        w.add(v)
    assert w.count == 5 and w.max == 10.0 and w.mean == pytest.approx(4.0)
    assert w.recent() == [1.0, 2.0, 3.0, 4.0]
    assert w.percentile(0) == 1.0 and w.percentile(100) == 4.0
    assert w.percentile(50) == pytest.approx(2.5)
    assert LatencyWindow().percentile(99) == 0.0
    with pytest.raises(ValueError):
        LatencyWindow(window=0)
