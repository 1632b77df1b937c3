"""The engine's KV events: published when an endpoint is set, not collected otherwise."""

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams
from kvoffload.events import BlockStored
from kvoffload.events.subscriber import KVEventSubscriber
from tests.events.published import record_published

BS = 8
PROMPTS = [[(7 * i + c) % 500 for i in range(40)] for c in range(3)]


def config(**kw) -> EngineConfig:
    return EngineConfig(
        block_size=BS,
        num_gpu_blocks=16,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_cpu_blocks=64,
        **kw,
    )


def test_engine_publishes_gpu_and_cpu_block_events() -> None:
    engine = LLMEngine(
        config(events_endpoint="tcp://127.0.0.1:*", events_replay_endpoint="tcp://127.0.0.1:*")
    )
    pub = engine.publisher
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as sub:
        engine.generate(PROMPTS, SamplingParams(max_tokens=4))
        engine.close()  # drains transfers, flushes and closes the publisher
        stored: dict[str, set[bytes]] = {}
        for _ in range(50):
            for rb in sub.recv(timeout_s=0.2):
                for ev in rb.batch.events:
                    if isinstance(ev, BlockStored):
                        stored.setdefault(ev.medium, set()).update(ev.block_hashes)
            if "CPU" in stored:
                break
    assert stored.get("GPU"), "no GPU-tier BlockStored received"
    assert stored.get("CPU"), "no CPU-tier BlockStored received"
    assert stored["CPU"] <= stored["GPU"]  # the CPU tier only holds blocks the GPU computed


def test_no_events_accumulate_without_a_publisher() -> None:
    engine = LLMEngine(config())
    try:
        engine.generate(PROMPTS, SamplingParams(max_tokens=4))
        engine.drain()
        assert engine.pool.take_events() == []
        assert engine.connector is not None
        assert list(engine.connector.manager.take_events()) == []
    finally:
        engine.close()


def test_salted_and_lora_requests_keep_their_extra_keys_in_gpu_events() -> None:
    # vLLM's block pool publishes each block's untagged extra keys: the salt in
    # the first block's only, the LoRA name in every block's (tests/compat checks
    # the same against vLLM's own code).
    engine = LLMEngine(config(events_endpoint="tcp://127.0.0.1:*"))
    published = record_published(engine)
    prompt = PROMPTS[0]
    kinds = {
        "plain": {},
        "salted": {"cache_salt": "tenant-1"},
        "lora": {"lora_name": "adapter-a", "lora_path": "/models/a"},
        "both": {"lora_name": "adapter-a", "lora_path": "/models/a", "cache_salt": "tenant-1"},
    }
    try:
        for name, extra in kinds.items():
            engine.add_request(prompt, SamplingParams(max_tokens=1), req_id=name, **extra)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.close()
    firsts = [
        e
        for e in published
        if isinstance(e, BlockStored) and e.medium == "GPU" and e.parent_block_hash is None
    ]
    # One chain per request: different extra keys, different hashes, no hit.
    assert len(firsts) == len(kinds)
    assert len({e.block_hashes[0] for e in firsts}) == len(kinds)
    n = len(prompt) // BS
    assert [e.extra_keys for e in firsts] == [
        [None] * n,
        [("tenant-1",)] + [None] * (n - 1),
        [("adapter-a",)] * n,
        [("adapter-a", "tenant-1")] + [("adapter-a",)] * (n - 1),
    ]
    assert [e.lora_name for e in firsts] == [None, None, "adapter-a", "adapter-a"]
