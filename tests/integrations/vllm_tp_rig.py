"""vLLM's real scheduler in this process, its worker-side connector in N worker processes (TP=N).

Import only from test modules that called ``need_vllm()`` first.

The layout of vLLM's multiprocess executor, played by hand: the scheduler
(with the scheduler-side connector, built by vLLM's factory from the public
names) lives here; each rank is a spawned process that builds the
worker-side connector for its rank from the same config, over its own CPU
"GPU" KV tensors (vLLM's ``allocate_kv_cache``, each rank holding its share of
the KV heads). Nothing is shared between the processes but what vLLM itself
shares: the pickled connector metadata each step, the workers' connector
outputs (aggregated with vLLM's ``KVOutputAggregator``) and, for the lower
tiers, vLLM's ``/dev/shm`` offload region.

Each rank "computes" a block by writing a pattern derived from the block's
hash and the rank into its KV bytes, and checks every block a finished load
wrote against that pattern: ``bytes_verified[rank]`` counts loaded bytes equal
to what that rank wrote.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.sched.scheduler import Scheduler

from tests.integrations.vllm_rank_pool import STEP_TIMEOUT_S, PoolDriver, RankPool, rank_stats
from tests.integrations.vllm_rig import (
    BLOCK_SIZE,
    NUM_KV_HEADS,
    kv_cache_config,
    load_targets,
    make_request,
    newly_computed_blocks,
    pattern,
    vllm_config,
    write_tiny_llama,
)
from tests.integrations.vllm_step_parts import (
    finish_reasons,
    finish_worker_step,
    new_scheduler,
    prefix_hash_fn,
    runner_output,
)

__all__ = ["STEP_TIMEOUT_S", "TPRig", "WorkerPool"]


def _tp_config(
    model_dir: str,
    num_gpu_blocks: int,
    extra_config: dict[str, Any],
    connector: dict[str, Any] | None,
    engine_id: str,
    tp: int,
    rank: int,
    recompute_failed_loads: bool,
) -> Any:
    config = vllm_config(
        Path(model_dir),
        num_gpu_blocks,
        extra_config,
        connector=connector,
        recompute_failed_loads=recompute_failed_loads,
    )
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.world_size = tp
    config.parallel_config.rank = rank
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.engine_id = engine_id
    return config


def _kv_cache_config(num_blocks: int, tp: int) -> Any:
    return kv_cache_config(num_blocks, NUM_KV_HEADS // tp)


# -- the worker process ---------------------------------------------------------------


class _Rank:
    """One rank's worker-side connector and fake model runner (runs in the worker process)."""

    def __init__(self, rank: int, build: dict[str, Any]) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.rank = rank
        config = _tp_config(rank=rank, **build)
        kcc = _kv_cache_config(build["num_gpu_blocks"], build["tp"])
        with set_current_vllm_config(config):
            self.connector = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, kcc
            )
            kv_caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
            self.connector.register_kv_caches(kv_caches)
        self.worker = self.connector.connector_worker.worker
        self.planes = self.worker.host_pool.layout.block_planes(self.worker.gpu_tensors)
        self.pending: dict[int, tuple[list[int], list[bytes]]] = {}
        self.bytes_verified = 0
        self.blocks_verified = 0
        self.mismatches: list[int] = []

    def _pattern(self, block_hash: bytes, plane: int, nbytes: int) -> np.ndarray:
        return pattern(block_hash, plane + 1000 * self.rank, nbytes).view(np.uint8)

    def _write(self, block_id: int, block_hash: bytes) -> None:
        import torch

        for p, plane in enumerate(self.planes):
            row = plane[block_id]
            row.copy_(torch.from_numpy(self._pattern(block_hash, p, row.numel())))

    def _check(self, block_id: int, block_hash: bytes) -> None:
        for p, plane in enumerate(self.planes):
            row = plane[block_id]
            if not np.array_equal(row.numpy(), self._pattern(block_hash, p, row.numel())):
                self.mismatches.append(block_id)
                return
            self.bytes_verified += row.numel()
        self.blocks_verified += 1

    def _verify(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            load = self.pending.pop(job_id, None)
            if load is None or job_id in self.worker.failed_job_ids:
                continue
            for block_id, block_hash in zip(*load):
                self._check(block_id, block_hash)

    def step(
        self,
        meta: Any,
        loads: dict[int, tuple[list[int], list[bytes], bool]],
        writes: list[tuple[int, bytes]],
        finished_req_ids: set[str],
    ) -> Any:
        wc = self.connector
        wc.bind_connector_metadata(meta)
        wc.handle_preemptions(meta)
        for job_id, (ids, hashes, _sync) in loads.items():
            self.pending[job_id] = (ids, hashes)
        wc.start_load_kv(None)
        self._verify([j for j, (_i, _h, sync) in loads.items() if sync])
        for block_id, block_hash in writes:
            self._write(block_id, block_hash)
        return finish_worker_step(
            wc, finished_req_ids, self.pending, self.worker.in_flight_job_ids, self._verify
        )

    def stats(self) -> dict[str, Any]:
        return {**rank_stats(self), "failed_jobs": self.worker.failed_jobs}


class WorkerPool(RankPool):
    """``tp`` spawned worker processes, reused across engines (vLLM is imported once each)."""

    def __init__(self, tp: int = 2) -> None:
        super().__init__(tp, _Rank)


# -- the scheduler side (this process) -------------------------------------------------------


@dataclass
class TPRig(PoolDriver):
    """vLLM's scheduler here, the worker-side connectors in ``pool``'s processes."""

    pool: WorkerPool
    scheduler: Scheduler
    hash_fn: Any
    engine_id: str
    aggregator: KVOutputAggregator
    first_computed: dict[str, int] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)
    steps: int = 0
    _next_id: int = 0

    @classmethod
    def build(
        cls,
        pool: WorkerPool,
        tmp_path: Path,
        extra_config: dict[str, Any],
        num_gpu_blocks: int = 12,
        connector: dict[str, Any] | None = None,
        recompute_failed_loads: bool = True,
        model_name: str = "tiny-llama",
    ) -> TPRig:
        from vllm.config import set_current_vllm_config

        model_dir = write_tiny_llama(tmp_path / model_name)
        engine_id = f"kvoffload-test-{uuid.uuid4().hex[:12]}"
        build = {
            "model_dir": str(model_dir),
            "num_gpu_blocks": num_gpu_blocks,
            "extra_config": dict(extra_config),
            "connector": connector,
            "engine_id": engine_id,
            "tp": pool.tp,
            "recompute_failed_loads": recompute_failed_loads,
        }
        # vLLM's order: the workers register their KV caches, then the scheduler starts.
        pool.call("build", build)
        config = _tp_config(rank=0, **build)
        hash_fn = prefix_hash_fn(config)
        with set_current_vllm_config(config):
            kcc = _kv_cache_config(num_gpu_blocks, pool.tp)
            scheduler = new_scheduler(config, kcc, BLOCK_SIZE)
        return cls(pool, scheduler, hash_fn, engine_id, KVOutputAggregator(pool.tp))

    @property
    def manager(self) -> Any:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector.connector_scheduler.manager

    def add(self, prompt: list[int], max_tokens: int = 2, req_id: str | None = None) -> str:
        if req_id is None:
            req_id = f"r{self._next_id}"
            self._next_id += 1
        self.scheduler.add_request(make_request(req_id, prompt, max_tokens, self.hash_fn))
        return req_id

    def _loads(self, meta: Any) -> dict[int, tuple[list[int], list[bytes], bool]]:
        return {
            job_id: (ids, hashes, sync)
            for job_id, (_, ids, hashes, sync) in load_targets(self.scheduler, meta).items()
        }

    def step(self) -> Any:
        output = self.scheduler.schedule()
        self.steps += 1
        for new in output.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        meta = output.kv_connector_metadata
        args = (
            meta,
            self._loads(meta),
            newly_computed_blocks(self.scheduler, output),
            set(output.finished_req_ids),
        )
        kv_outputs = self.pool.call("step", args)
        runner_outputs = [runner_output(self.scheduler, output, kv) for kv in kv_outputs]
        merged = self.aggregator.aggregate(runner_outputs)
        self.outputs.append(self.scheduler.update_from_output(output, merged))
        return output

    def finish_reasons(self) -> dict[str, str]:
        return finish_reasons(self.outputs)
