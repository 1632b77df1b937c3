"""Drive the reference engine through a chat trace and summarise what happened."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.demo.workload import (
    TraceRequest,
    WorkloadConfig,
    continuing_request_ids,
    generate_trace,
)
from kvoffload.engine.llm_engine import LLMEngine, RequestOutput
from kvoffload.engine.request import SamplingParams

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def demo_workload(vocab_size: int, num_requests: int = 256, seed: int = 0) -> WorkloadConfig:
    """The built-in multi-turn chat: small enough for 2 CPU cores, too big for the GPU tier."""
    return WorkloadConfig(
        num_requests=num_requests,
        num_conversations=min(64, max(8, num_requests // 4)),
        num_system_prompts=3,
        system_prompt_tokens=192,
        user_tokens=(16, 64),
        output_tokens=(8, 16),
        turns=(2, 6),
        max_context_tokens=1024,
        zipf_s=0.8,
        vocab_size=vocab_size,
        seed=seed,
    )


@dataclass
class ServeSummary:
    label: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    hit_rate_gpu: float
    hit_rate_cpu: float
    hit_rate_lower: float  # disk / remote tiers behind the CPU tier
    prefill_tokens_computed: int
    prefill_tokens_total: int
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    wall_s: float
    preemptions: int
    blocks_stored: int
    blocks_loaded: int

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def run_trace(
    engine: LLMEngine,
    trace: Sequence[TraceRequest],
    concurrency: int,
    label: str = "",
    progress: tuple[Progress, TaskID] | None = None,
    on_output: Callable[[RequestOutput], None] | None = None,
) -> ServeSummary:
    """Submit ``trace`` in order, at most ``concurrency`` requests in the engine at once.

    Each turn generates as many tokens as its scripted reply (the next turn's
    prompt carries the scripted reply, so the prefix structure stays the trace's).
    Every turn but its conversation's last in ``trace`` is sent with
    ``continues=True`` (the session hint; the trace's future decides it).
    ``progress`` is an optional ``rich.progress.Progress`` task pair ``(progress, task)``;
    ``on_output`` sees every finished request's output (with its logits when recorded).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    start = time.perf_counter()
    pending = list(reversed(trace))
    continuing = continuing_request_ids(trace)
    outputs: list[RequestOutput] = []
    in_flight = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            req = pending.pop()
            engine.add_request(
                req.prompt_token_ids,
                SamplingParams(max_tokens=len(req.output_token_ids)),
                req_id=req.req_id,
                continues=req.req_id in continuing,
            )
            in_flight += 1
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            out.logits = None  # the summary needs none of it; rows are vocab-sized
            outputs.append(out)
            in_flight -= 1
            if progress is not None:
                prog, task = progress
                prog.advance(task)
    engine.drain()
    wall = time.perf_counter() - start
    tier_stats = engine.tier_hit_breakdown()
    prompt_tokens = sum(o.prompt_len for o in outputs)
    ttfts = np.array([o.ttft_s for o in outputs]) if outputs else np.zeros(1)
    gpu_hits = sum(o.num_gpu_hit_tokens for o in outputs)
    tier_hits = sum(o.num_tier_hit_tokens for o in outputs)
    if tier_stats is None:
        cpu_hits, lower = tier_hits, 0
    else:  # tiered: split by where the loaded blocks came from
        cpu_hits, lower = tier_stats["cpu_hit_tokens"], tier_stats["lower_hit_tokens"]
    conn = engine.connector.stats if engine.connector is not None else None
    out_tokens = sum(len(o.output_token_ids) for o in outputs)
    return ServeSummary(
        label=label,
        requests=len(outputs),
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        hit_rate_gpu=gpu_hits / prompt_tokens if prompt_tokens else 0.0,
        hit_rate_cpu=cpu_hits / prompt_tokens if prompt_tokens else 0.0,
        hit_rate_lower=lower / prompt_tokens if prompt_tokens else 0.0,
        prefill_tokens_computed=sum(o.num_prefill_tokens_computed for o in outputs),
        prefill_tokens_total=prompt_tokens,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        throughput_tok_s=(prompt_tokens + out_tokens) / wall if wall > 0 else 0.0,
        wall_s=wall,
        preemptions=sum(o.num_preemptions for o in outputs),
        blocks_stored=conn.blocks_stored if conn else 0,
        blocks_loaded=conn.blocks_loaded if conn else 0,
    )


def serve(
    config: EngineConfig,
    workload: WorkloadConfig | None = None,
    concurrency: int = 8,
    label: str = "",
    show_progress: bool = False,
    on_output: Callable[[RequestOutput], None] | None = None,
) -> ServeSummary:
    """Build an engine from ``config``, replay the (demo) workload, close the engine."""
    engine = LLMEngine(config)
    try:
        wl = workload or demo_workload(engine.runner.vocab_size, seed=config.seed)
        trace = list(generate_trace(wl))
        if not show_progress:
            return run_trace(engine, trace, concurrency, label, on_output=on_output)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=False,
        ) as prog:
            task = prog.add_task(label or "serving", total=len(trace))
            return run_trace(engine, trace, concurrency, label, (prog, task), on_output)
    finally:
        engine.close()
