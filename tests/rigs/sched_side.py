"""One spec on vLLM 0.33's real scheduler, the worker simulated: ``hybrid_sched``'s harness.

vLLM's own ``Scheduler`` (scheduler side only, no model) runs with a hybrid
``KVCacheConfig`` from vLLM's planner and ``OffloadingConnector`` (or
kvoffload's ``KVOffloadConnector``). Every transfer job the scheduler issues is
reported done in the step it was issued (what the scheduler sees of a worker
that copies instantly). The connector's scheduler-side methods are timed on the
instance; cached tokens are the connector's last answer of
``get_num_new_matched_tokens`` before the request was scheduled.

vLLM is imported lazily: the core package never imports it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 64
#: "kvoffload": vLLM's OffloadingConnector + KVOffloadSpec; "kvoffload-conn": kvoffload's
#: KVOffloadConnector (the same spec, plus its queue hints and in-step CPU hits);
#: "vllm": OffloadingConnector + vLLM's CPUOffloadingSpec (the baseline of every ratio).
SPECS = ("kvoffload", "kvoffload-conn", "vllm")
#: Connector methods the scheduler calls (timed on the instance when present).
CONNECTOR_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
    "on_new_request",
    "get_external_cache_hit_sources",
)


def layer_kinds(groups: int, window: int) -> list[tuple[str, int | None]]:
    """Layers that vLLM's planner groups into ``groups`` groups: one full, the rest windowed.

    Two layers per group (same page size), as a Gemma 3 style model with a
    1:1 (2 groups) or 1:3 (4 groups) full : sliding layer ratio.
    """
    if groups < 2:
        return [("full", None)] * 2
    kinds: list[tuple[str, int | None]] = []
    for _ in range(2):
        kinds.append(("full", None))
        kinds.extend([("sliding", window)] * (groups - 1))
    return kinds


def _specs(kinds: list[tuple[str, int | None]]) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    out: dict[str, Any] = {}
    for i, (kind, window) in enumerate(kinds):
        common = dict(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
        spec = (
            FullAttentionSpec(**common)  # type: ignore[arg-type]
            if kind == "full"
            else SlidingWindowSpec(**common, sliding_window=window)  # type: ignore[arg-type]
        )
        out[f"model.layers.{i}.self_attn.attn"] = spec
    return out


def _write_model(directory: Path, num_layers: int, max_len: int) -> Path:
    """A local tiny Llama ``config.json`` (no weights): vLLM's ``ModelConfig`` needs one."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": num_layers,
        "vocab_size": 1000,
        "max_position_embeddings": max_len,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@dataclass
class SideResult:
    spec: str
    steps: int = 0
    step_s: float = 0.0
    connector_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gpu_cached_tokens: int = 0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    requests: int = 0
    chunk_bytes: list[int] = field(default_factory=list)
    num_slots: int = 0
    calls: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.requests, 1)
        return {
            "spec": self.spec,
            "steps": self.steps,
            "step_us": 1e6 * self.step_s / max(self.steps, 1),
            "connector_us_per_step": 1e6 * self.connector_s / max(self.steps, 1),
            "step_us_per_request": 1e6 * self.step_s / n,
            "connector_us_per_request": 1e6 * self.connector_s / n,
            "hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
            "cached_tokens": self.cached_tokens,
            "gpu_cached_tokens": self.gpu_cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "stored_keys": self.stored_chunks,
            "loaded_keys": self.loaded_chunks,
            "bytes_per_chunk_per_group": self.chunk_bytes,
            "cpu_slots": self.num_slots,
            "connector_us_by_call": {k: 1e6 * v for k, v in sorted(self.calls.items())},
        }


@contextmanager
def _capture_spec() -> Iterator[list[Any]]:
    """The ``OffloadingSpec`` the connector builds (vLLM keeps no reference to it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as oc

    factory = oc.OffloadingSpecFactory
    original = factory.create_spec
    seen: list[Any] = []

    def create_spec(*args: Any, **kwargs: Any) -> Any:
        spec = original(*args, **kwargs)
        seen.append(spec)
        return spec

    factory.create_spec = create_spec  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        factory.create_spec = original  # type: ignore[method-assign]


def _timed(
    result: SideResult, name: str, fn: Callable[..., Any], depth: list[int]
) -> Callable[..., Any]:
    """``fn`` timed into ``result``; only the outermost of nested timed calls counts (a
    connector's method may call another one through ``self``: counted once)."""
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0] += 1
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = clock() - t0
            depth[0] -= 1
            result.connector_s += dt
            result.calls[name] = result.calls.get(name, 0.0) + dt

    return wrapper


def _chunk_bytes(spec: Any, groups: int) -> tuple[list[int], int]:
    plan = getattr(spec, "slot_plan", None)
    if plan is not None:
        per = [plan.group_slot_bytes(g) * plan.world_size for g in range(groups)]
        return per, int(getattr(spec, "num_slots", 0))
    return [int(spec.kv_bytes_per_chunk)] * groups, int(getattr(spec, "num_chunks", 0))


def _connector_config(which: str, cpu_bytes: int) -> dict[str, Any]:
    """``KVTransferConfig`` fields naming the connector and spec of one side."""
    if which == "kvoffload":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {
                "cpu_bytes": cpu_bytes,
                "spec_name": "KVOffloadSpec",
                "spec_module_path": "kvoffload.integrations.vllm",
            },
        }
    if which == "kvoffload-conn":
        return {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_connector_extra_config": {"cpu_bytes": cpu_bytes},
        }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes,
            "spec_name": "CPUOffloadingSpec",
        },
    }


def _vllm_config(model_dir: Path, max_len: int, max_batched_tokens: int, which: str,
                 cpu_bytes: int, num_gpu_blocks: int) -> Any:  # fmt: skip
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=max_len
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=max_batched_tokens,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_role="kv_both", **_connector_config(which, cpu_bytes)
        ),
    )
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    config.cache_config.kv_cache_layout = "LBHNC"
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _scheduler(config: Any, kinds: list[tuple[str, int | None]], num_gpu_blocks: int,
               result: SideResult) -> Any:  # fmt: skip
    """vLLM's ``Scheduler`` over the planner's hybrid ``KVCacheConfig``; the spec's sizes
    go into ``result``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
    except ImportError:  # vLLM 0.32: the same functions, older home
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[no-redef]
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )

    specs = _specs(kinds)
    with set_current_vllm_config(config), _capture_spec() as seen:
        kv_groups = get_kv_cache_groups(config, dict(specs))
        per_block = kv_groups[0].kv_cache_spec.page_size_bytes * len(kv_groups[0].layer_names)
        kcc = get_kv_cache_config_from_groups(config, kv_groups, per_block * num_gpu_blocks)
        kcc.num_blocks = num_gpu_blocks
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
    if seen:
        result.chunk_bytes, result.num_slots = _chunk_bytes(seen[-1], len(kcc.kv_cache_groups))
    return scheduler


def _instrument(connector: Any, result: SideResult) -> dict[str, int]:
    """Time the connector's scheduler-side methods; the returned dict fills with each
    request's last external hit (tokens)."""
    hits: dict[str, int] = {}
    depth = [0]
    for name in CONNECTOR_METHODS:
        fn = getattr(connector, name, None)
        if callable(fn):
            wrapped = _timed(result, name, fn, depth)
            if name == "get_num_new_matched_tokens":
                inner = wrapped

                def wrapped(request: Any, *args: Any, _inner: Any = inner, **kw: Any) -> Any:
                    out = _inner(request, *args, **kw)
                    hits[request.request_id] = int(out[0] or 0)
                    return out

            setattr(connector, name, wrapped)
    return hits


def _simulated_worker(scheduler: Any, output: Any, jobs: Any, result: SideResult) -> Any:
    """The model runner's output for ``output``: every job done at once, prompts that are
    fully computed sample one token."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    meta = output.kv_connector_metadata
    done = OffloadingWorkerMetadata()
    recving: set[str] = set()
    for job_id, job in meta.load_jobs.items():
        result.loaded_chunks += len(jobs[job_id].keys)
        done.mark_completed(job_id)
        if not getattr(job, "sync", False):
            recving.add(job.req_id)
    for job_id in meta.store_jobs:
        result.stored_chunks += len(jobs[job_id].keys)
        done.mark_completed(job_id)
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        request = scheduler.requests.get(rid)
        finished = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if finished else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: j for j, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(
            finished_recving=recving,
            kv_connector_worker_meta=done if done.completed_jobs else None,
        ),
    )


def _serve(scheduler: Any, req_id: str, jobs: Any, result: SideResult, which: str) -> int:
    """Step the scheduler until it is idle; the tokens computed when ``req_id`` was first
    scheduled (its prefix hit, GPU and CPU)."""
    clock = time.perf_counter
    first_computed: int | None = None
    for _ in range(100_000):
        if not scheduler.has_requests():
            return first_computed or 0
        t0 = clock()
        output = scheduler.schedule()
        dt = clock() - t0
        for new in output.scheduled_new_reqs:
            if new.req_id == req_id and first_computed is None:
                first_computed = new.num_computed_tokens
        runner = _simulated_worker(scheduler, output, jobs, result)
        t0 = clock()
        scheduler.update_from_output(output, runner)
        result.step_s += dt + clock() - t0
        result.steps += 1
    raise RuntimeError(f"{which}: request {req_id} never finished")


def run_side(
    which: str,
    prompts: list[list[int]],
    groups: int,
    window: int,
    cpu_bytes: int,
    num_gpu_blocks: int,
    max_batched_tokens: int,
    workdir: Path,
    progress: Callable[[], None] | None = None,
) -> SideResult:
    """One spec on the real scheduler over ``prompts`` (token lists), sequentially admitted."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    kinds = layer_kinds(groups, window)
    max_len = max(len(p) for p in prompts) + 64
    model_dir = _write_model(workdir / "model", len(kinds), max_len)
    config = _vllm_config(model_dir, max_len, max_batched_tokens, which, cpu_bytes, num_gpu_blocks)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    result = SideResult(which)
    scheduler = _scheduler(config, kinds, num_gpu_blocks, result)
    connector = scheduler.connector
    assert connector is not None
    hits = _instrument(connector, result)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    jobs = connector.connector_scheduler._jobs
    try:
        for i, prompt in enumerate(prompts):
            req_id = f"r{i}"
            scheduler.add_request(
                Request(
                    request_id=req_id,
                    prompt_token_ids=list(prompt),
                    sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
            result.requests += 1
            result.prompt_tokens += len(prompt)
            first_computed = _serve(scheduler, req_id, jobs, result, which)
            ext = hits.get(req_id, 0)
            result.cached_tokens += ext
            result.gpu_cached_tokens += max(0, first_computed - ext)
            if progress is not None:
                progress()
    finally:
        connector.shutdown()
    return result
