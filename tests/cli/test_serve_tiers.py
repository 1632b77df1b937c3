"""A small CPU tier with disk or Redis behind it beats the CPU tier alone.

Deterministic: a scripted rig steps the engine through the demo trace and
settles every transfer after each step (``engine.drain()``), so the schedule,
and with it every hit rate, is the same on a quiet or a loaded machine. The
timing-dependent comparison (transfers racing the model) is what
``kvoffload bench serve --disk-dir/--redis-url`` prints; it is not asserted.
"""

from dataclasses import dataclass

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams
from kvoffload.engine.demo.workload import WorkloadConfig, generate_trace

CONCURRENCY = 4
# Multi-turn chat, small: 16 conversations' prefixes outgrow the GPU tier (24
# blocks of 8) and the CPU tier (48 blocks), but fit in the tiers below.
WORKLOAD = dict(
    num_requests=36,
    num_conversations=16,
    num_system_prompts=2,
    system_prompt_tokens=48,
    user_tokens=(8, 24),
    output_tokens=(2, 4),
    turns=(2, 5),
    max_context_tokens=256,
    zipf_s=0.5,
)


@dataclass
class Hits:
    prompt_tokens: int
    gpu: int
    cpu: int
    lower: int
    prefill_computed: int
    outputs: dict[str, list[int]]

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.lower


def serve_stepwise(**overrides: object) -> Hits:
    """The demo trace through one engine, every transfer settled after each step."""
    config = EngineConfig(
        block_size=8,
        num_gpu_blocks=24,
        max_num_batched_tokens=128,
        num_cpu_blocks=48,
        store_mode="eager",
        **overrides,  # type: ignore[arg-type]
    )
    engine = LLMEngine(config)
    try:
        wl = WorkloadConfig(vocab_size=engine.runner.vocab_size, **WORKLOAD)  # type: ignore[arg-type]
        trace = list(generate_trace(wl))
        pending = list(reversed(trace))
        outputs = {}
        while pending or engine.has_unfinished_requests():
            while pending and len(engine._requests) < CONCURRENCY:
                req = pending.pop()
                params = SamplingParams(max_tokens=len(req.output_token_ids))
                engine.add_request(req.prompt_token_ids, params, req_id=req.req_id)
            for out in engine.step():
                outputs[out.req_id] = out
            engine.drain()  # the scripted part: no transfer outlives its step
        breakdown = engine.tier_hit_breakdown()
        tier = sum(o.num_tier_hit_tokens for o in outputs.values())
        cpu, lower = (
            (tier, 0)
            if breakdown is None
            else (breakdown["cpu_hit_tokens"], breakdown["lower_hit_tokens"])
        )
        return Hits(
            prompt_tokens=sum(o.prompt_len for o in outputs.values()),
            gpu=sum(o.num_gpu_hit_tokens for o in outputs.values()),
            cpu=cpu,
            lower=lower,
            prefill_computed=sum(o.num_prefill_tokens_computed for o in outputs.values()),
            outputs={k: o.output_token_ids for k, o in outputs.items()},
        )
    finally:
        engine.close()


def assert_lower_tier_helps(tiered: Hits, cpu_only: Hits) -> None:
    assert tiered.prompt_tokens == cpu_only.prompt_tokens
    assert tiered.lower > 0, "the lower tier never served a prefix"
    assert tiered.total > cpu_only.total
    assert tiered.prefill_computed < cpu_only.prefill_computed
    assert tiered.outputs == cpu_only.outputs  # a tier changes where KV comes from, not what


def test_stepwise_rig_is_deterministic() -> None:
    a, b = serve_stepwise(), serve_stepwise()
    assert (a.gpu, a.cpu, a.prefill_computed) == (b.gpu, b.cpu, b.prefill_computed)
    assert a.cpu > 0


def test_disk_tier_behind_a_small_cpu_tier(tmp_path) -> None:
    assert_lower_tier_helps(serve_stepwise(disk_dir=str(tmp_path / "disk")), serve_stepwise())


def test_redis_tier_behind_a_small_cpu_tier(redis_server) -> None:
    assert_lower_tier_helps(serve_stepwise(redis_url=redis_server.url), serve_stepwise())
