"""The reference engine: scheduler + model runner + offloading, one step at a time.

One ``step()``:
1. settle finished transfers (loads wake their requests, stores release refs);
2. schedule the batch (continuous batching, chunked prefill, preemption);
3. hand the connector's new load jobs to the worker;
4. run the model on the batch and sample;
5. register newly computed blocks in the GPU prefix cache, queue stores
   (eager) or walk the free queue (lazy), submit them, publish KV events.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvoffload.blocks import BlockPool
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.connector import OffloadingConnectorScheduler, SimpleCPUOffloadScheduler
from kvoffload.engine.kv_cache_manager import KVCacheManager
from kvoffload.engine.model_runner import ModelRunner
from kvoffload.engine.offload_setup import OffloadSetup, build_offload
from kvoffload.engine.request import Request, RequestStatus, SamplingParams
from kvoffload.engine.scheduler import Scheduler
from kvoffload.engine.stats import EngineStats
from kvoffload.engine.threads import apply_thread_policy
from kvoffload.events import KVEvent
from kvoffload.events.publisher import make_publisher, restart_safe_first_seq
from kvoffload.hashing import get_hash_fn_by_name, make_none_hash
from kvoffload.offload.media import CPU_MEDIUM

TRANSFER_TIMEOUT_S = 300.0
MAX_IDLE_STEPS = 10_000
# A step with nothing to run but requests whose tier lookup is deferred waits this
# long at most for the answers (returning as soon as they land): a busy engine never
# waits, and a dead server costs a request at most this times the connector's bound.
LOOKUP_WAIT_S = 0.02


@dataclass
class RequestOutput:
    req_id: str
    prompt_len: int
    output_token_ids: list[int]
    ttft_s: float
    latency_s: float
    num_gpu_hit_tokens: int
    num_tier_hit_tokens: int
    num_prefill_tokens_computed: int
    num_preemptions: int
    # [len(output_token_ids), vocab]: the row each output token was sampled from,
    # only when EngineConfig.record_logits (kvoffload run --verify).
    logits: torch.Tensor | None = None


__all__ = ["EngineStats", "LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        apply_thread_policy(config.num_threads)
        self.hash_fn = get_hash_fn_by_name(config.hash_fn)
        # The chain seed is per engine, not global, so two engines in one process
        # (tests) and two processes sharing a Redis tier agree when seeded alike.
        self.none_hash = make_none_hash(self.hash_fn, config.hash_seed)
        self.runner = ModelRunner(config)
        # Events are collected only when they are published: nobody drains them otherwise.
        self.pool = BlockPool(
            config.num_gpu_blocks,
            enable_caching=True,
            enable_kv_cache_events=config.publishes_events,
            events_mode=config.events_mode,
        )
        self.pool.announce_empty()  # a restarted instance's stale entries go first
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.offload: OffloadSetup | None = None
        self.connector: OffloadingConnectorScheduler | None = None
        if config.offload_enabled:
            self.offload = build_offload(config, self.pool, self.runner)
            self.connector = self.offload.connector
        self.scheduler = Scheduler(
            self.kv, self.connector, config.max_num_seqs, config.max_num_batched_tokens
        )
        topic = {} if config.events_topic is None else {"topic": config.events_topic}
        self.publisher = make_publisher(
            config.events_endpoint,
            config.events_replay_endpoint,
            events_format=config.events_format,
            first_seq=restart_safe_first_seq(),  # a restart is a new stream to routers
            **topic,  # type: ignore[arg-type]
        )
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._outputs: list[RequestOutput] = []
        self._next_id = 0
        self._idle_steps = 0

    # -- requests -------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        continues: bool = False,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id.

        ``lora_name`` / ``lora_path`` and ``cache_salt`` go into its block
        hashes and KV events exactly as vLLM 0.33 puts a LoRA request's and a
        salt's (the reference model has no adapters: they only keep KV apart).
        """
        vocab = self.runner.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if req_id is None:
            req_id = f"req-{self._next_id}"
            self._next_id += 1
        if req_id in self._requests:
            raise ValueError(f"duplicate request id {req_id!r}")
        sampling = sampling or SamplingParams()
        total = len(prompt_token_ids) + sampling.max_tokens
        max_tokens_in_pool = (self.config.num_gpu_blocks - 1) * self.config.block_size
        if total > max_tokens_in_pool:
            raise ValueError(
                f"request {req_id} needs up to {total} tokens of KV but the GPU tier holds "
                f"{max_tokens_in_pool}"
            )
        if total > self.runner.max_position:
            raise ValueError(f"request {req_id}: {total} tokens exceed the model's max position")
        req = Request(
            req_id,
            [int(t) for t in prompt_token_ids],
            sampling,
            self.config.block_size,
            self.hash_fn,
            parent_hash=self.none_hash,
            continues=continues,
            lora_name=lora_name,
            cache_salt=cache_salt,
            lora_path=lora_path,
        )
        self._requests[req_id] = req
        self.scheduler.add_request(req)
        self.stats.prompt_tokens += len(prompt_token_ids)
        return req_id

    def abort_request(self, req_id: str) -> None:
        req = self._requests.pop(req_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish_request(req, RequestStatus.ABORTED)
            self.runner.release(req_id)
            self.stats.aborted_requests += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------

    def _settle_transfers(self, block: bool) -> None:
        if self.offload is None or self.connector is None:
            return
        worker = self.offload.worker
        if block and self.connector.num_in_flight_jobs():
            # A request waiting for its load should not also wait for every store.
            ids = self.connector.in_flight_job_ids(loads_only=bool(self.scheduler.loading))
            ids = ids or self.connector.in_flight_job_ids()
            if not worker.wait(ids, timeout=TRANSFER_TIMEOUT_S):
                # A copy that never ends must fail loudly, not hang the engine.
                raise RuntimeError(
                    f"transfer jobs {ids[:8]} still running after {TRANSFER_TIMEOUT_S:.0f} s"
                )
        results = worker.get_finished()
        if results:
            loaded, failed = self.connector.update_connector_output(results)
            self.scheduler.finish_loads(loaded, failed)

    def _submit_jobs(self) -> None:
        if self.offload is None or self.connector is None:
            return
        meta = self.connector.build_connector_meta()
        for job in meta.loads:
            self.offload.submit(job)
        for job in meta.stores:
            self.offload.submit(job)

    def step(self) -> list[RequestOutput]:
        self._settle_transfers(block=False)
        out = self.scheduler.schedule()
        self._submit_jobs()  # loads for requests admitted just now
        if not out.scheduled:
            if self.scheduler.loading or (self.connector and self.connector.num_in_flight_jobs()):
                self._settle_transfers(block=True)
                self._idle_steps = 0
            elif out.deferred and self.connector is not None:
                self.connector.wait_for_lookups(LOOKUP_WAIT_S)
            elif self.scheduler.has_work():
                self._idle_steps += 1
                if self._idle_steps > MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"engine made no progress in {MAX_IDLE_STEPS} steps: "
                        f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} "
                        f"running, {self.pool.get_num_free_blocks()} free GPU blocks"
                    )
            self._publish_events()
            return self._take_outputs()
        self._idle_steps = 0
        self.stats.steps += 1
        reqs = [r for r, _ in out.scheduled]
        counts = [n for _, n in out.scheduled]
        sampled = self.runner.execute(reqs, counts)
        now = time.perf_counter()
        for req, n in out.scheduled:
            # Every token computed that is not the newest one is prefill work,
            # including recompute after preemption.
            req.num_prefill_tokens_computed += n if n > 1 or not req.output_token_ids else 0
            req.num_computed_tokens += n
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if self.connector is not None:
                self.connector.on_blocks_computed(
                    req.req_id, req.blocks, req.block_hashes, req.num_computed_tokens
                )
            if req.req_id not in sampled:
                continue  # a prefill chunk that did not reach the end
            req.append_output(sampled[req.req_id])
            if self.runner.record_logits:
                req.logits_rows.append(self.runner.last_logits[req.req_id])
            if req.first_token_time is None:
                req.first_token_time = now
            if req.should_stop():
                req.finish_time = now
                self.scheduler.finish_request(req, RequestStatus.FINISHED)
                self._record(req)
        if isinstance(self.connector, SimpleCPUOffloadScheduler):
            self.connector.schedule_lazy_stores(self._lazy_window())
        self._submit_jobs()
        self._publish_events()
        return self._take_outputs()

    def _lazy_window(self) -> int:
        if self.config.lazy_window_blocks is not None:
            return self.config.lazy_window_blocks
        bs = self.config.block_size
        return -(-self.config.max_num_batched_tokens // bs) + self.config.max_num_seqs

    def _record(self, req: Request) -> None:
        out = RequestOutput(
            req_id=req.req_id,
            prompt_len=len(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            ttft_s=(req.first_token_time or 0.0) - req.arrival_time,
            latency_s=(req.finish_time or 0.0) - req.arrival_time,
            num_gpu_hit_tokens=req.num_gpu_hit_tokens or 0,
            num_tier_hit_tokens=req.num_tier_hit_tokens,
            num_prefill_tokens_computed=req.num_prefill_tokens_computed,
            num_preemptions=req.num_preemptions,
            logits=torch.stack(req.logits_rows) if req.logits_rows else None,  # type: ignore[arg-type]
        )
        req.logits_rows = []
        s = self.stats
        s.prefill_tokens_computed += out.num_prefill_tokens_computed
        s.decode_tokens += len(out.output_token_ids)
        s.gpu_hit_tokens += out.num_gpu_hit_tokens
        s.tier_hit_tokens += out.num_tier_hit_tokens
        s.preemptions += out.num_preemptions
        s.finished_requests += 1
        s.ttft_s.add(out.ttft_s)
        s.latency_s.add(out.latency_s)
        self._outputs.append(out)
        del self._requests[req.req_id]
        self.runner.release(req.req_id)

    def _take_outputs(self) -> list[RequestOutput]:
        outs, self._outputs = self._outputs, []
        return outs

    def tier_hit_breakdown(self) -> dict[str, int] | None:
        """Tokens loaded from the CPU tier and from the tiers below it, when tiered."""
        by_medium = (
            getattr(self.offload.manager, "hit_blocks_by_medium", None) if self.offload else None
        )
        if by_medium is None:
            return None
        loaded = by_medium()
        bs = self.config.block_size
        cpu = loaded.get(CPU_MEDIUM, 0)
        lower = sum(n for medium, n in loaded.items() if medium != CPU_MEDIUM)
        return {"cpu_hit_tokens": cpu * bs, "lower_hit_tokens": lower * bs}

    def take_kv_events(self) -> list[KVEvent]:
        events = self.pool.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        return events

    def _publish_events(self) -> None:
        if self.config.publishes_events:
            events = self.take_kv_events()
            if events:
                self.publisher.publish(events)

    # -- reset ----------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block: the GPU prefix cache and every tier this engine owns.

        All or nothing: returns False, changing nothing, while a transfer is
        in flight, a request holds GPU blocks, or a tier has a block pinned or
        being stored (vLLM 0.33 refuses likewise while blocks are in use).
        Run it after a weight update, so no tier serves KV of the old weights.
        Events: the GPU tier's ``AllBlocksCleared`` and, per secondary tier, a
        ``BlockRemoved`` of every block it held with that tier's ``medium``
        (``AllBlocksCleared`` has no medium field in vLLM's wire format). A
        shared remote tier forgets only what this instance knows of it (see
        ``RemoteOffloadingManager.reset_cache``), so other instances keep theirs.
        """
        if self.connector is not None and self.connector.num_in_flight_jobs():
            return False
        if self.pool.get_num_free_blocks() != self.pool.num_blocks - 1:
            return False  # a request (running, or waiting after a load) holds blocks
        manager = self.offload.manager if self.offload is not None else None
        if manager is not None and not manager.can_reset_cache():
            return False
        if not self.pool.reset_prefix_cache():
            return False
        if manager is not None:
            if not manager.reset_cache():
                raise RuntimeError("offload tier refused a reset it had just allowed")
            if isinstance(self.connector, SimpleCPUOffloadScheduler):
                # The lazy walk's cursor and handled count describe the old cache.
                self.connector.walker = type(self.connector.walker)(self.pool)
        self._publish_events()
        return True

    # -- convenience ----------------------------------------------------------

    def generate(
        self, prompts: Iterable[Sequence[int]], sampling: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        ids = [self.add_request(p, sampling) for p in prompts]
        done: dict[str, list[int]] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                done[out.req_id] = out.output_token_ids
        return [done[i] for i in ids]

    def drain(self) -> None:
        """Wait for every in-flight transfer and settle it."""
        while self.connector is not None and self.connector.num_in_flight_jobs():
            self._settle_transfers(block=True)

    def close(self) -> None:
        self.drain()
        if self.offload is not None:
            self.offload.close()
        self.publisher.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
