"""vLLM's real scheduler here, hybrid-model worker-side connectors in N spawned processes (TP=N).

Import only from test modules that called ``need_vllm()`` first.

``vllm_tp_rig``'s layout (vLLM's multiprocess executor played by hand) for
models with several KV cache groups: each rank builds vLLM's groups and KV
tensors for its share of the KV heads (``vllm_groups_rig``), "computes" every
full block of every group by writing a pattern of (block hash, group, layer,
rank) into the group's layers, and checks every block a finished load wrote.
Nothing passes between the processes but what vLLM itself passes: the
pickled connector metadata and the workers' connector outputs (aggregated
with vLLM's ``KVOutputAggregator``), and, with lower tiers, vLLM's
``/dev/shm`` offload region.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.scheduler import Scheduler

from tests.integrations.vllm_groups_rig import (
    KINDS,
    LayerPatterns,
    full_blocks,
    groups_kv_cache_config,
    hybrid_vllm_config,
    layer_specs,
    load_blocks,
)
from tests.integrations.vllm_rank_pool import STEP_TIMEOUT_S, PoolDriver, RankPool, rank_stats
from tests.integrations.vllm_rig import BLOCK_SIZE, make_request, write_tiny_llama
from tests.integrations.vllm_step_parts import (
    finish_worker_step,
    new_scheduler,
    prefix_hash_fn,
    runner_output,
)

__all__ = ["STEP_TIMEOUT_S", "GroupsTPRig", "GroupsWorkerPool", "rank_specs"]


def rank_specs(kind: str, tp: int) -> dict[str, Any]:
    """The kind's layers as one rank sees them: its share of each layer's KV heads."""
    specs = []
    for spec in KINDS[kind]():
        heads = getattr(spec, "num_kv_heads", 1)
        if heads >= tp and heads % tp == 0:
            spec = dataclasses.replace(spec, num_kv_heads=heads // tp)
        specs.append(spec)
    return layer_specs(specs)


class _Rank:
    def __init__(self, rank: int, build: dict[str, Any]) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        config = hybrid_vllm_config(
            Path(build["model_dir"]),
            build["num_gpu_blocks"],
            build["extra_config"],
            build["connector"],
            tp=build["tp"],
            rank=rank,
            engine_id=build["engine_id"],
        )
        with set_current_vllm_config(config):
            specs = rank_specs(build["kind"], build["tp"])
            kcc = groups_kv_cache_config(config, specs, build["num_gpu_blocks"])
            self.connector = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, kcc
            )
            layout = config.cache_config.get_resolved_kv_cache_layout()
            kv_caches = allocate_kv_cache(kcc, torch.device("cpu"), layout)
            self.connector.register_kv_caches(kv_caches)
        self.worker = self.connector.connector_worker.worker
        self.patterns = LayerPatterns(kv_caches, kcc, salt=f"/rank{rank}")
        self.pending: dict[int, list[tuple[int, int, bytes]]] = {}
        self.bytes_verified = 0
        self.blocks_verified = 0
        self.mismatches: list[tuple[int, int]] = []

    def _verify(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            for g, block_id, block_hash in self.pending.pop(job_id, []):
                n = self.patterns.check(g, block_id, block_hash)
                if n is None:
                    self.mismatches.append((g, block_id))
                else:
                    self.bytes_verified += n
                    self.blocks_verified += 1

    def step(self, meta: Any, loads: dict[int, Any], writes: list[Any], finished: set[str]) -> Any:
        wc = self.connector
        wc.bind_connector_metadata(meta)
        wc.handle_preemptions(meta)
        self.pending.update({job_id: blocks for job_id, (blocks, _s) in loads.items()})
        wc.start_load_kv(None)
        self.worker.wait_all(timeout=60)
        for g, block_id, block_hash in writes:
            self.patterns.write(g, block_id, block_hash)
        return finish_worker_step(
            wc, finished, self.pending, self.worker.in_flight_job_ids, self._verify
        )

    def stats(self) -> dict[str, Any]:
        return rank_stats(self)


class GroupsWorkerPool(RankPool):
    """``tp`` spawned worker processes, reused across engines."""

    def __init__(self, tp: int = 2) -> None:
        super().__init__(tp, _Rank)


@dataclass
class GroupsTPRig(PoolDriver):
    pool: GroupsWorkerPool
    scheduler: Scheduler
    hash_fn: Any
    aggregator: KVOutputAggregator
    first_computed: dict[str, int] = field(default_factory=dict)
    loaded_blocks: int = 0

    @classmethod
    def build(
        cls,
        pool: GroupsWorkerPool,
        tmp_path: Path,
        kind: str,
        extra_config: dict[str, Any],
        connector: dict[str, Any],
        num_gpu_blocks: int = 40,
    ) -> GroupsTPRig:
        from vllm.config import set_current_vllm_config

        build = {
            "model_dir": str(write_tiny_llama(tmp_path / "tiny")),
            "num_gpu_blocks": num_gpu_blocks,
            "extra_config": dict(extra_config),
            "connector": connector,
            "engine_id": f"kvoffload-test-{uuid.uuid4().hex[:12]}",
            "tp": pool.tp,
            "kind": kind,
        }
        pool.call("build", build)  # vLLM's order: workers register, then the scheduler
        config = hybrid_vllm_config(
            Path(build["model_dir"]),
            num_gpu_blocks,
            extra_config,
            connector,
            tp=pool.tp,
            engine_id=build["engine_id"],
        )
        hash_fn = prefix_hash_fn(config)
        with set_current_vllm_config(config):
            kcc = groups_kv_cache_config(config, rank_specs(kind, pool.tp), num_gpu_blocks)
            scheduler = new_scheduler(config, kcc, BLOCK_SIZE)
        return cls(pool, scheduler, hash_fn, KVOutputAggregator(pool.tp))

    def add(self, prompt: list[int], req_id: str, max_tokens: int = 2) -> None:
        self.scheduler.add_request(make_request(req_id, prompt, max_tokens, self.hash_fn))

    def step(self) -> Any:
        output = self.scheduler.schedule()
        for new in output.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        meta = output.kv_connector_metadata
        loads = {
            job_id: (blocks, sync)
            for job_id, (_r, blocks, sync) in load_blocks(self.scheduler, meta).items()
        }
        self.loaded_blocks += sum(len(b) for b, _s in loads.values())
        args = (meta, loads, full_blocks(self.scheduler, output), set(output.finished_req_ids))
        kv_outputs = self.pool.call("step", args)
        runner_outputs = [runner_output(self.scheduler, output, kv) for kv in kv_outputs]
        self.scheduler.update_from_output(output, self.aggregator.aggregate(runner_outputs))
        return output
