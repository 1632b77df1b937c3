"""A CPU-only vLLM 0.33 engine loop around the real ``Scheduler`` and worker-side connector.

Import only from test modules that called ``need_vllm()`` first.

The model never runs: ``VLLMRig.step`` plays the model runner. It binds the
scheduler's connector metadata to vLLM's worker-side connector (built by
vLLM's ``KVConnectorFactory`` from the public names, with KV tensors from
vLLM's own ``allocate_kv_cache`` on the CPU), starts the connector's loads,
"computes" every newly computed full block by writing a pattern derived from
the block's hash into all of its KV bytes, finishes the step's connector
work and feeds a fake ``ModelRunnerOutput`` back. Every block a load job
wrote is compared with its pattern once the job is done, so
``bytes_verified`` counts loaded bytes equal to what was written.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.integrations.vllm import KVOffloadManager, KVOffloadWorker
from tests.integrations.vllm_step_parts import (
    finish_reasons,
    finish_worker_step,
    new_scheduler,
    prefix_hash_fn,
    runner_output,
)

BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
}
CONNECTOR = {
    "kv_connector": "KVOffloadConnector",
    "kv_connector_module_path": "kvoffload.integrations.vllm",
    "kv_role": "kv_both",
}


def write_tiny_llama(directory: Path) -> Path:
    """A local tiny Llama ``config.json`` (no weights, no tokenizer, no hub)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def vllm_config(
    model_dir: Path,
    num_gpu_blocks: int,
    extra_config: dict[str, Any] | None,
    connector: dict[str, Any] | None = None,
    kv_events_endpoint: str | None = None,
    recompute_failed_loads: bool = False,
    async_scheduling: bool | None = None,
) -> VllmConfig:
    """A CPU ``VllmConfig`` for the tiny model; ``extra_config=None``: no connector at all."""
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=1024
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_gpu_blocks
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    transfer = None
    if extra_config is not None:
        transfer = KVTransferConfig(
            **(connector or CONNECTOR),
            kv_connector_extra_config=dict(extra_config),
            kv_load_failure_policy="recompute" if recompute_failed_loads else "fail",
        )
    events = None
    if kv_events_endpoint is not None:
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=kv_events_endpoint,
            replay_endpoint=None,
            topic="kv",
        )
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer,
        kv_events_config=events,
    )


def kv_cache_config(num_blocks: int, num_kv_heads: int = NUM_KV_HEADS) -> KVCacheConfig:
    """One KV tensor for every layer; ``num_kv_heads``: one rank's share of the heads."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=HEAD_SIZE, dtype=torch.float16
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=num_blocks * NUM_LAYERS * page,
        layers=names,
        layer_stride=page,
        block_stride=NUM_LAYERS * page,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def make_request(
    req_id: str, prompt: list[int], max_tokens: int, hash_fn: Callable[[Any], bytes]
) -> Request:
    """A greedy request of ``max_tokens`` tokens, hashed as vLLM's engine hashes it."""
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn),
    )


def newly_computed_blocks(scheduler: Scheduler, output: Any) -> list[tuple[int, bytes]]:
    """(GPU block id, block hash) of each block that this step's tokens made full."""
    out = []
    for req_id, n in output.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
        end = request.num_computed_tokens
        for idx in range((end - n) // BLOCK_SIZE, end // BLOCK_SIZE):
            if idx < len(request.block_hashes) and (idx + 1) * BLOCK_SIZE <= end:
                out.append((block_ids[idx], bytes(request.block_hashes[idx])))
    return out


def load_targets(
    scheduler: Scheduler, metadata: Any
) -> dict[int, tuple[str, list[int], list[bytes], bool]]:
    """Per load job: its request, the GPU blocks it writes, their hashes, and whether it is
    synchronous (vLLM 0.32 has no synchronous loads)."""
    out = {}
    for job_id, job in metadata.load_jobs.items():
        request = scheduler.requests[job.req_id]
        dst = job.dst_spec
        first = int(dst.block_indices[0])
        ids = [int(b) for b in dst.block_ids]
        hashes = [bytes(request.block_hashes[first + i]) for i in range(len(ids))]
        # vLLM 0.33 marks its own synchronous jobs; kvoffload's 0.32 path lists them.
        sync = bool(getattr(job, "sync", False)) or job_id in getattr(
            metadata, "sync_load_jobs", ()
        )
        out[job_id] = (job.req_id, ids, hashes, sync)
    return out


def pattern(block_hash: bytes, plane: int, nbytes: int) -> np.ndarray:
    """The bytes the fake model "computes" for one plane row of the block with this hash."""
    digest = hashlib.shake_128(bytes(block_hash) + plane.to_bytes(2, "big")).digest(nbytes)
    return np.frombuffer(bytearray(digest), dtype=np.int8)


@dataclass
class _PendingLoad:
    req_id: str
    gpu_blocks: list[int]
    hashes: list[bytes]


@dataclass
class VLLMRig:
    """vLLM's scheduler and worker-side connector in one process, stepped by hand."""

    config: VllmConfig
    scheduler: Scheduler
    worker_connector: OffloadingConnector | None
    kv_caches: dict[str, torch.Tensor]
    hash_fn: Any
    first_computed: dict[str, int] = field(default_factory=dict)
    bytes_verified: int = 0
    blocks_verified: int = 0
    mismatches: list[tuple[str, int]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    #: Synchronous load jobs still running when the forward pass would start (a bug).
    late_sync_loads: list[int] = field(default_factory=list)
    #: Synchronous load jobs seen (each finished before its step's forward pass).
    sync_loads: list[int] = field(default_factory=list)
    #: The fake forward pass calls ``wait_for_layer_load`` before each layer's attention,
    #: in ``kv_caches`` order, and checks that layer's KV of the step's synchronous loads.
    forward_layers: bool = False
    #: (job, layer) whose KV was not in place when that layer's attention would read it.
    early_reads: list[tuple[int, str]] = field(default_factory=list)
    #: Called with each layer's name after its check (tests look at the planes then).
    on_layer: Any = None
    _pending: dict[int, _PendingLoad] = field(default_factory=dict)
    _written: dict[int, bytes] = field(default_factory=dict)
    _next_id: int = 0

    @classmethod
    def build(
        cls,
        tmp_path: Path,
        num_gpu_blocks: int = 12,
        extra_config: dict[str, Any] | None = None,
        scheduler_cls: type[Scheduler] = Scheduler,
        **config_kwargs: Any,
    ) -> VLLMRig:
        model_dir = write_tiny_llama(tmp_path / "tiny-llama")
        config = vllm_config(model_dir, num_gpu_blocks, extra_config, **config_kwargs)
        kcc = kv_cache_config(num_gpu_blocks)
        hash_fn = prefix_hash_fn(config)
        with set_current_vllm_config(config):
            worker = None
            kv_caches: dict[str, torch.Tensor] = {}
            if config.kv_transfer_config is not None:
                # vLLM builds the worker first (it sizes the KV cache), then the scheduler.
                worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
                kv_caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
                assert isinstance(worker, OffloadingConnector)
                worker.register_kv_caches(kv_caches)
            scheduler = new_scheduler(config, kcc, BLOCK_SIZE, scheduler_cls)
        return cls(config, scheduler, worker, kv_caches, hash_fn)

    # -- requests ------------------------------------------------------------------

    def add(self, prompt: list[int], max_tokens: int = 2, req_id: str | None = None) -> str:
        if req_id is None:
            req_id = f"r{self._next_id}"
            self._next_id += 1
        request = make_request(req_id, prompt, max_tokens, self.hash_fn)
        self.scheduler.add_request(request)
        return req_id

    # -- the fake model runner -------------------------------------------------------

    @property
    def kv_worker(self) -> KVOffloadWorker:
        assert self.worker_connector is not None
        worker = self.worker_connector.connector_worker.worker
        assert isinstance(worker, KVOffloadWorker)
        return worker

    def _planes(self) -> list[torch.Tensor]:
        return [p for p in self.kv_worker.host_pool.layout.block_planes(self.kv_worker.gpu_tensors)]

    def _write_block(self, block_id: int, block_hash: bytes) -> None:
        for p, plane in enumerate(self._planes()):
            row = plane[block_id]
            row.copy_(torch.from_numpy(pattern(block_hash, p, row.numel()).view(np.uint8)))
        self._written[block_id] = bytes(block_hash)

    def _check_block(self, req_id: str, block_id: int, block_hash: bytes) -> None:
        for p, plane in enumerate(self._planes()):
            row = plane[block_id]
            want = pattern(block_hash, p, row.numel()).view(np.uint8)
            if not np.array_equal(row.numpy(), want):
                self.mismatches.append((req_id, block_id))
                return
            self.bytes_verified += row.numel()
        self.blocks_verified += 1

    def _compute(self, output: Any) -> None:
        """Write the KV of every block that became fully computed in this step."""
        if self.worker_connector is None:
            return
        for block_id, block_hash in newly_computed_blocks(self.scheduler, output):
            self._write_block(block_id, block_hash)

    def _note_loads(self, metadata: Any) -> list[int]:
        sync = []
        for job_id, (req_id, ids, hashes, is_sync) in load_targets(
            self.scheduler, metadata
        ).items():
            self._pending[job_id] = _PendingLoad(req_id, ids, hashes)
            if is_sync:
                sync.append(job_id)
        return sync

    def _verify_done(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            load = self._pending.pop(job_id, None)
            if load is None or job_id in self.kv_worker.failed_job_ids:
                continue  # a failed load's blocks go to vLLM's recovery, not to the model
            for block_id, block_hash in zip(load.gpu_blocks, load.hashes):
                self._check_block(load.req_id, block_id, block_hash)

    def layer_spans(self) -> dict[str, tuple[int, int, int]]:
        """Each layer's bytes in the block rows, by KV address: (plane, start, stop)."""
        planes = self._planes()
        out = {}
        for name, t in self.kv_caches.items():
            ptr, size = t.data_ptr(), t[0].numel() * t.element_size()
            for p, plane in enumerate(planes):
                base = plane.data_ptr()
                if base <= ptr < base + plane.shape[1]:
                    out[name] = (p, ptr - base, ptr - base + size)
        assert out.keys() == self.kv_caches.keys()
        return out

    def layer_in_place(self, span: tuple[int, int, int], block_id: int, block_hash: bytes) -> bool:
        p, a, b = span
        row = self._planes()[p][block_id]
        want = pattern(block_hash, p, row.numel()).view(np.uint8)
        return np.array_equal(row.numpy()[a:b], want[a:b])

    def _attend(self, wc: Any, sync: list[int]) -> None:
        """The layers of a forward pass: each waits for its KV, which must then be in place."""
        for name, span in self.layer_spans().items():
            wc.wait_for_layer_load(name)
            for job_id in sync:
                load = self._pending[job_id]
                blocks = zip(load.gpu_blocks, load.hashes)
                if not all(self.layer_in_place(span, b, h) for b, h in blocks):
                    self.early_reads.append((job_id, name))
            if self.on_layer is not None:
                self.on_layer(name)

    def step(self) -> Any:
        output = self.scheduler.schedule()
        self.preempted |= set(output.preempted_req_ids or ())
        for new in output.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        connector_output = None
        wc = self.worker_connector
        if wc is not None:
            meta = output.kv_connector_metadata
            wc.bind_connector_metadata(meta)
            wc.handle_preemptions(meta)
            sync = self._note_loads(meta)
            # vLLM's model runner runs the loads and the forward pass in inference mode.
            with torch.inference_mode():
                wc.start_load_kv(None)  # type: ignore[arg-type]
                # A synchronous load must be done before the forward pass; its bytes are
                # checked with the others once get_finished says whether it failed.
                self.sync_loads += sync
                if self.forward_layers:
                    self._attend(wc, sync)
                elif not self.kv_worker.worker.wait(sync, timeout=0):
                    self.late_sync_loads += sync
            self._compute(output)
            connector_output = finish_worker_step(
                wc,
                output.finished_req_ids,
                self._pending,
                lambda: self.kv_worker.worker._job_handler,
                self._verify_done,
            )
        runner = runner_output(self.scheduler, output, connector_output)
        self.outputs.append(self.scheduler.update_from_output(output, runner))
        return output

    def run(self, max_steps: int = 200) -> int:
        """Step until no request is left and no transfer is in flight; the steps taken."""
        for n in range(max_steps):
            if not self.scheduler.has_requests() and not self._transfers_in_flight():
                return n
            output = self.step()
            if not output.total_num_scheduled_tokens and self.worker_connector is not None:
                # Nothing to compute: only transfers can make progress. Wait for them
                # instead of spinning, so the step count does not depend on I/O speed.
                assert self.kv_worker.wait_all(timeout=60), "transfers stuck for 60 s"
                if not isinstance(self.manager, KVOffloadManager):
                    # vLLM's tiering: lower-tier jobs and lookups run in the scheduler
                    # process, answered at a later step.
                    time.sleep(0.002)
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def _transfers_in_flight(self) -> bool:
        if self.worker_connector is None:
            return False
        manager = self.manager
        if isinstance(manager, KVOffloadManager):
            return self.kv_worker.num_in_flight() > 0 or bool(manager.num_in_flight())
        return self.kv_worker.num_in_flight() > 0 or manager.has_pending_work()

    @property
    def manager(self) -> Any:
        """``KVOffloadManager`` (CPU tier only) or ``KVOffloadTieringManager`` (lower tiers)."""
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector.connector_scheduler.manager

    def finish_reasons(self) -> dict[str, str]:
        """Each finished request's finish reason, by request id."""
        return finish_reasons(self.outputs)

    def shutdown(self) -> None:
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        if self.worker_connector is not None:
            self.worker_connector.shutdown()
