"""LLMEngine.reset_prefix_cache: clears the GPU cache and every tier, all or nothing."""

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams
from kvoffload.events import AllBlocksCleared, BlockRemoved

BS = 8
PROMPTS = [[(7 * i + 3 * c) % 500 for i in range(40)] for c in range(3)]


def config(**kw) -> EngineConfig:
    base = dict(
        block_size=BS,
        num_gpu_blocks=16,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_cpu_blocks=64,
    )
    base.update(kw)
    return EngineConfig(**base)


def test_reset_clears_gpu_and_cpu_tiers_and_emits_events() -> None:
    engine = LLMEngine(config())
    engine.pool.enable_kv_cache_events = True  # collect without a publisher
    engine.offload.manager.enable_events = True
    try:
        engine.generate(PROMPTS, SamplingParams(max_tokens=2))
        engine.drain()
        engine.take_kv_events()
        mgr = engine.offload.manager
        stored = mgr.num_blocks - mgr.num_free_blocks()
        assert stored > 0 and engine.pool.cached_block_hash_to_block
        assert engine.reset_prefix_cache()
        assert not engine.pool.cached_block_hash_to_block
        assert mgr.num_free_blocks() == mgr.num_blocks
        events = engine.take_kv_events()
        assert any(isinstance(e, AllBlocksCleared) for e in events)
        removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert sum(len(e.block_hashes) for e in removed) == stored
        # Served again from scratch: no hit in any tier, same tokens.
        before = engine.stats.gpu_hit_tokens + engine.stats.tier_hit_tokens
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
        assert engine.stats.gpu_hit_tokens + engine.stats.tier_hit_tokens == before
    finally:
        engine.close()


def test_reset_refuses_while_transfers_are_in_flight_or_blocks_in_use() -> None:
    engine = LLMEngine(config())
    try:
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
        engine.step()  # a running request holds GPU blocks, eager stores queued
        cached = dict(engine.pool.cached_block_hash_to_block)
        assert engine.connector.num_in_flight_jobs() or engine.has_unfinished_requests()
        assert engine.reset_prefix_cache() is False
        assert engine.pool.cached_block_hash_to_block == cached  # nothing changed
        while engine.has_unfinished_requests():
            engine.step()
        # Requests done, stores maybe still in flight: refused until they settle.
        if engine.connector.num_in_flight_jobs():
            assert engine.reset_prefix_cache() is False
        engine.drain()
        assert engine.reset_prefix_cache() is True
    finally:
        engine.close()


def test_reset_without_offload() -> None:
    engine = LLMEngine(config(store_mode="off"))
    try:
        first = engine.generate(PROMPTS, SamplingParams(max_tokens=3))
        assert engine.reset_prefix_cache()
        assert engine.generate(PROMPTS, SamplingParams(max_tokens=3)) == first
    finally:
        engine.close()
