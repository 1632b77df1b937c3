"""Disk and Redis tiers behind the CPU tier, for the reference engine."""

from __future__ import annotations

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.model_identity import engine_model_identity
from kvoffload.engine.model_runner import ModelRunner
from kvoffload.hashing.block_hash import none_hash_seed_is_random, resolve_none_hash_seed
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.base import OffloadingManager
from kvoffload.tiers.stack import make_lower_tiers
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.worker import OffloadingWorker


def build_lower_tiers(
    config: EngineConfig,
    cpu: CPUOffloadingManager,
    host_pool: HostPool,
    worker: OffloadingWorker,
    runner: ModelRunner,
) -> tuple[OffloadingManager, tuple[object, ...]]:
    """The tiered manager over ``cpu`` and the closers of the stores below it.

    Configuration errors (unwritable directory, a directory written by an
    incompatible engine, a malformed Redis URL) raise here, before serving.
    """
    tiers = make_lower_tiers(
        cpu,
        host_pool,
        runner.kv_tensors,
        runner.layout,
        hash_fn=config.hash_fn,
        model_id=engine_model_identity(config.model_path, runner.model_config, config.seed),
        hash_seed=_fingerprint_seed(config),
        disk_dir=config.disk_dir,
        disk_bytes=config.disk_bytes,
        disk_blocks=None if config.disk_bytes else config.num_disk_blocks,
        redis_url=config.redis_url,
        write_mode="write_through" if config.write_through else "write_back",
        enable_events=config.publishes_events,
        num_threads=config.transfer_threads,
    )
    tiers.register(worker)
    return tiers.manager, (tiers,)


def _fingerprint_seed(config: EngineConfig) -> str | None:
    """The chain seed as a tier records it: None (per process) only when it is drawn at random.

    sha256's fixed default is a real, shared seed: engines that leave
    ``hash_seed`` unset must match one that names that default.
    """
    if none_hash_seed_is_random(config.hash_fn, config.hash_seed):
        return None
    return resolve_none_hash_seed(config.hash_fn, config.hash_seed)
