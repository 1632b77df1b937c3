"""Wiring of the offload path for the reference engine: manager, pool, worker, connector."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.blocks import BlockPool
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.connector import SimpleCPUOffloadScheduler, TransferJob
from kvoffload.engine.model_runner import ModelRunner
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.base import OffloadingManager
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.sizing import num_cpu_blocks
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.worker import OffloadingWorker


@dataclass
class OffloadSetup:
    manager: OffloadingManager
    connector: SimpleCPUOffloadScheduler
    worker: OffloadingWorker
    host_pool: HostPool
    closers: tuple[object, ...] = ()

    def submit(self, job: TransferJob) -> None:
        spec = TransferSpec(job.src, job.dst)
        if job.is_store:
            self.worker.submit_store(job.job_id, spec)
        else:
            self.worker.submit_load(job.job_id, spec)

    def close(self) -> None:
        self.worker.close()
        for c in self.closers:
            c.close()  # type: ignore[attr-defined]


def build_offload(config: EngineConfig, pool: BlockPool, runner: ModelRunner) -> OffloadSetup:
    if config.cpu_bytes is not None:
        n_cpu = num_cpu_blocks(config.cpu_bytes, runner.geometry)
    else:
        n_cpu = config.num_cpu_blocks
    host_pool = HostPool(runner.layout, n_cpu)
    cpu = CPUOffloadingManager(
        n_cpu,
        config.cache_policy or DEFAULT_CACHE_POLICY,
        enable_events=config.publishes_events,
    )
    worker = OffloadingWorker.for_cpu_tier(
        runner.kv_tensors, runner.layout, host_pool, config.transfer_threads
    )
    manager: OffloadingManager = cpu
    closers: tuple[object, ...] = ()
    if config.has_lower_tiers:
        from kvoffload.engine.tier_setup import build_lower_tiers

        manager, closers = build_lower_tiers(config, cpu, host_pool, worker, runner)
    connector = SimpleCPUOffloadScheduler(
        pool, manager, config.block_size, store_mode=config.store_mode
    )
    connector.events.self_describing = config.events_self_describing
    connector.events.keep_payloads_in(config.disk_dir if config.publishes_events else None)
    return OffloadSetup(manager, connector, worker, host_pool, closers)
