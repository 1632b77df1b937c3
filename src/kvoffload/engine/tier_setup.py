"""Disk and Redis tiers behind the CPU tier, for the reference engine."""

from __future__ import annotations

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.model_identity import engine_model_identity
from kvoffload.engine.model_runner import ModelRunner
from kvoffload.hashing.block_hash import none_hash_seed_is_random, resolve_none_hash_seed
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.base import OffloadingManager
from kvoffload.tiers.config import TierIdentity
from kvoffload.tiers.stack import make_tiers
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
    tier_config = config.tier_config()
    if tier_config is None:
        raise ValueError("EngineConfig names no lower tier (disk_dir, redis_url or mooncake_url)")
    identity = TierIdentity(
        model_id=engine_model_identity(config.model_path, runner.model_config, config.seed),
        hash_fn=config.hash_fn,
        hash_seed=_fingerprint_seed(config),
    )
    tiers = make_tiers(cpu, host_pool, runner.kv_tensors, runner.layout, tier_config, identity)
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
