"""Hybrid KV cache groups on vLLM 0.33's real scheduler: kvoffload vs vLLM's CPU spec.

``kvoffload bench hybrid-sched``. vLLM's own ``Scheduler`` (scheduler side
only, no model) runs with a hybrid ``KVCacheConfig`` from vLLM's planner
(one full-attention layer group plus one or three sliding-window groups) and
``OffloadingConnector``, once with ``KVOffloadSpec`` (kvoffload's default
policy, its chunk-unit layer) and once with vLLM's ``CPUOffloadingSpec``, on
the same requests and the same CPU bytes. The worker side is simulated: every
transfer job the scheduler issues is reported done in the step it was issued
(what the scheduler sees of a worker that copies instantly), so both sides see
the same timing and only scheduler-side decisions and costs are compared.

Invariants of the measurement:
- both specs get the same ``cpu_bytes`` and the same request stream (long
  prompts with prefix revisits from ``hybrid_replay.long_prompts``; the GPU
  pool is small so revisits are served from the CPU tier or recomputed);
- "connector time" is the time inside the connector's scheduler-side methods
  (wrapped on the instance); "step time" is ``schedule()`` plus
  ``update_from_output()`` and includes vLLM's own scheduling, which is the
  same code for both rows;
- cached tokens are the connector's hit per request (the last answer of
  ``get_num_new_matched_tokens`` before the request was scheduled).

vLLM is imported lazily: the core package never imports it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.bench.policy.hybrid_replay import long_prompts

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
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
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

    kinds = layer_kinds(groups, window)
    max_len = max(len(p) for p in prompts) + 64
    model_dir = _write_model(workdir / "model", len(kinds), max_len)
    connector_name: dict[str, Any] = {"kv_connector": "OffloadingConnector"}
    if which == "kvoffload":
        extra: dict[str, Any] = {
            "cpu_bytes": cpu_bytes,
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.integrations.vllm",
        }
    elif which == "kvoffload-conn":
        extra = {"cpu_bytes": cpu_bytes}
        connector_name = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
        }
    else:
        extra = {"cpu_bytes_to_use": cpu_bytes, "spec_name": "CPUOffloadingSpec"}
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
            **connector_name,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    config.cache_config.kv_cache_layout = "LBHNC"
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
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
    result = SideResult(which)
    n_groups = len(kcc.kv_cache_groups)
    if seen:
        result.chunk_bytes, result.num_slots = _chunk_bytes(seen[-1], n_groups)
    connector = scheduler.connector
    assert connector is not None
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
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    clock = time.perf_counter
    jobs = connector.connector_scheduler._jobs  # type: ignore[attr-defined]
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
            first_computed: int | None = None
            for _ in range(100_000):
                if not scheduler.has_requests():
                    break
                t0 = clock()
                output = scheduler.schedule()
                dt = clock() - t0
                for new in output.scheduled_new_reqs:
                    if new.req_id == req_id and first_computed is None:
                        first_computed = new.num_computed_tokens
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
                    finished = (
                        request is not None and request.num_computed_tokens >= request.num_tokens
                    )
                    sampled.append([7] if finished else [])
                runner = ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: j for j, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=KVConnectorOutput(
                        finished_recving=recving,
                        kv_connector_worker_meta=done if done.completed_jobs else None,
                    ),
                )
                t0 = clock()
                scheduler.update_from_output(output, runner)
                result.step_s += dt + clock() - t0
                result.steps += 1
            else:
                raise RuntimeError(f"{which}: request {req_id} never finished")
            ext = hits.get(req_id, 0)
            result.cached_tokens += ext
            result.gpu_cached_tokens += max(0, (first_computed or 0) - ext)
            if progress is not None:
                progress()
    finally:
        connector.shutdown()
    return result


GRAIN = 256


def token_prompts(num_requests: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``hybrid_replay.long_prompts`` as tokens: ``GRAIN`` tokens per chunk id.

    Chunk ids are equal exactly where prefixes are equal, so equal prompt
    prefixes give equal block hashes and nothing else does.
    """
    out = []
    for chunks in long_prompts(num_requests, prompt_tokens, GRAIN, seed):
        out.append([(c * GRAIN + j) % 50_000 + 1 for c in chunks for j in range(GRAIN)])
    return out


def distinct_blocks(num_requests: int, prompt_tokens: int, seed: int) -> int:
    """GPU blocks of distinct prefixes in the workload (one group's worth)."""
    ids = {c for p in long_prompts(num_requests, prompt_tokens, GRAIN, seed) for c in p}
    return len(ids) * GRAIN // BLOCK_SIZE


def bench(
    configs: list[tuple[int, int]],
    num_requests: int,
    prompt_tokens: int,
    cpu_fraction: float,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Every (groups, window) layout with both specs; ratios are kvoffload / vLLM.

    Each spec first runs one request untimed in a scratch scheduler, so that
    neither side's first point pays for imports and first-call set-up.
    """
    prompts = token_prompts(num_requests, prompt_tokens, seed)
    for which in SPECS:
        with tempfile.TemporaryDirectory(prefix="kvo-hsched-") as tmp:
            run_side(which, prompts[:1], 2, 128, 1 << 24, 4096, 2048, Path(tmp))
    distinct = distinct_blocks(num_requests, prompt_tokens, seed)
    max_batched = 2048
    points = []
    for groups, window in configs:
        page = 2 * NUM_KV_HEADS * HEAD_SIZE * 2 * BLOCK_SIZE * 2  # K+V, fp16, 2 layers
        # Equal CPU bytes: a fraction of the full-attention group's distinct blocks (the
        # windowed groups' stored blocks are few beside them), so the tier must evict.
        cpu_bytes = max(int(cpu_fraction * distinct * page), 64 * page)
        # A small GPU pool (one prompt and a bit): revisits must come from the CPU tier.
        per_prompt = max(len(p) for p in prompts) // BLOCK_SIZE + 8
        per_window = (window + max_batched) // BLOCK_SIZE + 8
        num_gpu_blocks = int(1.25 * (per_prompt + per_window * (groups - 1)))
        sides: dict[str, dict[str, Any]] = {}
        for rep in range(repeats):
            # Interleaved repeats, the fastest kept: a shared host's noise only adds time.
            for which in SPECS:
                if progress is not None:
                    progress(f"{groups}g-w{window} {which} ({rep + 1}/{repeats})")
                with tempfile.TemporaryDirectory(prefix="kvo-hsched-") as tmp:
                    got = run_side(
                        which,
                        prompts,
                        groups,
                        window,
                        cpu_bytes,
                        num_gpu_blocks,
                        max_batched,
                        Path(tmp),
                        (lambda: progress("")) if progress is not None else None,
                    ).as_dict()
                best = sides.get(which)
                if best is not None and got["cached_tokens"] != best["cached_tokens"]:
                    raise RuntimeError(f"{which}: decisions differ between repeats")
                if best is None or got["step_us"] < best["step_us"]:
                    sides[which] = got
        theirs = sides["vllm"]

        def ratio(
            key: str, which: str = "kvoffload", sides: dict = sides, theirs: dict = theirs
        ) -> float | None:
            return sides[which][key] / theirs[key] if theirs[key] else None

        points.append(
            {
                "layout": f"{groups}g-w{window}",
                "groups": groups,
                "window": window,
                "cpu_bytes": cpu_bytes,
                "gpu_blocks": num_gpu_blocks,
                "sides": sides,
                "step_time_ratio": ratio("step_us"),
                "connector_time_ratio": ratio("connector_us_per_step"),
                "per_request_ratio": ratio("step_us_per_request"),
                "hit_rate_ratio": ratio("hit_rate"),
                "conn_step_time_ratio": ratio("step_us", "kvoffload-conn"),
                "conn_connector_time_ratio": ratio("connector_us_per_step", "kvoffload-conn"),
                "conn_hit_rate_ratio": ratio("hit_rate", "kvoffload-conn"),
            }
        )
    return {
        "bench": "hybrid-sched",
        "requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "block_size": BLOCK_SIZE,
        "cpu_fraction": cpu_fraction,
        "repeats": repeats,
        "points": points,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=24, help="requests per layout (24)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=16384, help="first-turn prompt tokens (16384)"
    )
    parser.add_argument("--groups", default="2,4", help="KV cache groups, comma-separated (2,4)")
    parser.add_argument(
        "--windows", default="128,1024", help="sliding windows in tokens, comma-separated"
    )
    parser.add_argument(
        "--cpu-fraction",
        type=float,
        default=0.3,
        help="CPU bytes as a fraction of the full group's distinct blocks (0.3)",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="interleaved runs per spec, fastest kept (2)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _table(report: dict[str, Any]) -> list[str]:
    head = (
        f"{'layout':<9} {'spec':<14} {'steps':>6} {'step us':>9} {'conn us/step':>12} "
        f"{'ms/req':>8} {'hit %':>7} {'gpu %':>6} {'stored':>8} {'loaded':>8}  bytes/chunk/group"
    )
    lines = [head]
    for p in report["points"]:
        for which in SPECS:
            s = p["sides"][which]
            lines.append(
                f"{p['layout']:<9} {which:<14} {s['steps']:>6} {s['step_us']:>9.0f} "
                f"{s['connector_us_per_step']:>12.0f} {s['step_us_per_request'] / 1e3:>8.1f} "
                f"{100 * s['hit_rate']:>6.2f}% "
                f"{100 * s['gpu_cached_tokens'] / max(s['prompt_tokens'], 1):>5.1f}% "
                f"{s['stored_keys']:>8} {s['loaded_keys']:>8}  "
                + ",".join(str(b) for b in s["bytes_per_chunk_per_group"])
            )

        def fmt(x: float | None) -> str:
            return f"{x:.2f}x" if x is not None else "-"

        lines.append(
            f"{p['layout']:<9} {'conn/vLLM':<14} step {fmt(p['conn_step_time_ratio'])}, "
            f"connector {fmt(p['conn_connector_time_ratio'])}, "
            f"hit rate {fmt(p['conn_hit_rate_ratio'])}"
        )
        lines.append(
            f"{p['layout']:<9} {'ours/vLLM':<14} step {fmt(p['step_time_ratio'])}, "
            f"connector {fmt(p['connector_time_ratio'])}, per request "
            f"{fmt(p['per_request_ratio'])}, hit rate {fmt(p['hit_rate_ratio'])} "
            f"(CPU {p['cpu_bytes'] >> 20} MiB each)"
        )
    return lines


def _configs(args: argparse.Namespace) -> list[tuple[int, int]]:
    groups = [int(x) for x in str(args.groups).split(",") if x]
    windows = [int(x) for x in str(args.windows).split(",") if x]
    return [(g, w) for g in groups for w in windows]


def run(args: argparse.Namespace) -> int:
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as exc:  # any import failure: there is nothing to compare against
        print(f"bench hybrid-sched needs vLLM 0.33: {type(exc).__name__}: {exc}")
        return 2
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    configs = _configs(args)

    def measure(progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        return bench(
            configs,
            args.requests,
            args.prompt_tokens,
            args.cpu_fraction,
            args.seed,
            progress,
            args.repeats,
        )

    if args.json:
        print(json.dumps(measure()))
        return 0
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    with Progress(console=console, transient=True) as bar:
        total = len(configs) * len(SPECS) * args.requests * args.repeats
        task = bar.add_task("scheduling", total=total)

        def progress(what: str) -> None:
            if what:
                bar.update(task, description=what)
            else:
                bar.update(task, advance=1)

        report = measure(progress)
    console.print(
        "vLLM 0.33's scheduler, worker simulated (jobs done at once); time: schedule() + "
        "update_from_output() per step, connector: its scheduler-side calls; hit: CPU-tier "
        "tokens / prompt tokens at equal CPU bytes (noisy shared host)"
    )
    for line in _table(report):
        console.print(line, highlight=False)
    return 0
