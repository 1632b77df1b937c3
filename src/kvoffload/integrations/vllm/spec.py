"""``KVOffloadSpec``: kvoffload's tiers as a vLLM 0.33 ``OffloadingSpec``.

vLLM builds one spec on the scheduler side (``get_manager``) and one per
worker (``get_worker``). The CPU tier needs nothing shared between them: both
sides size it from the same config (``cpu_bytes`` over the offloaded block's
bytes on all workers). Lower tiers do: the disk tier's index and the Redis
tier's presence checks live next to their stores, so the worker side builds
the whole stack and the scheduler side takes its manager from a per-process
registry (keyed by vLLM's engine id). That needs the worker in the
scheduler's process, which is vLLM's layout for one GPU (the uniproc
executor); elsewhere ``disk_dir``/``redis_url`` is refused at start-up.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import threading
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvoffload.integrations.vllm.manager import KVOffloadManager
from kvoffload.integrations.vllm.settings import (
    KVOffloadConfigError,
    KVOffloadSettings,
    parse_settings,
)
from kvoffload.integrations.vllm.worker import KVOffloadWorker, plane_layout
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.tiered_manager import TieredOffloadingManager
from kvoffload.tiers.stack import make_lower_tiers
from kvoffload.transfer import HostPool, format_bytes

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload")

_registry_lock = threading.Lock()
_tiered_by_engine: dict[str, TieredOffloadingManager] = {}


def model_identity(config: OffloadingConfig) -> str:
    """What decides the offloaded bytes besides page geometry: model, dtype, tokens, hash."""
    revision = "main"
    hash_algo = "sha256"
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - 0.33 has it
        vllm_config = None
    if vllm_config is not None:
        revision = str(vllm_config.model_config.revision or "main")
        hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    blocks = ",".join(str(g.tokens_per_block) for g in config.groups)
    return (
        f"vllm:{config.model.name}@{revision};kv_dtype={config.model.dtype};"
        f"tokens_per_block={blocks};tokens_per_hash={config.cache.tokens_per_hash};"
        f"hash={hash_algo}"
    )


class KVOffloadSpec(OffloadingSpec):
    """kvoffload's CPU tier (and disk/Redis tiers below it) behind vLLM's offloading connector.

    Use with vLLM's stock connector: ``"kv_connector": "OffloadingConnector"``,
    ``"spec_name": "KVOffloadSpec"``, ``"spec_module_path":
    "kvoffload.integrations.vllm"``. Extra-config keys: ``settings``.
    """

    #: Set by ``KVOffloadConnector`` before the worker is built: failed loads go to
    #: vLLM's load-failure recovery instead of vLLM's assertion.
    recover_failed_loads: bool = False

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings: KVOffloadSettings = parse_settings(self.extra_config)
        if len(config.groups) != 1:
            raise KVOffloadConfigError(
                f"kvoffload offloads models with one KV cache group, this one has "
                f"{len(config.groups)}"
            )
        world = max(1, config.parallel.world_size)
        slot_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.num_slots = 0
        if slot_bytes > 0:
            self.num_slots = self.settings.cpu_bytes // (slot_bytes * world)
            if self.num_slots < 1:
                raise KVOffloadConfigError(
                    "kv_connector_extra_config['cpu_bytes']: "
                    f"{format_bytes(self.settings.cpu_bytes)} is smaller than one offloaded "
                    f"block on {world} worker(s) "
                    f"({slot_bytes * world} bytes)"
                )
        self.identity = model_identity(config)
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None
        if self.num_slots:
            logger.info(
                "kvoffload: CPU tier of %d blocks (%s per worker), policy %s%s%s",
                self.num_slots,
                format_bytes(self.num_slots * slot_bytes),
                self.settings.cache_policy,
                f", disk {self.settings.disk_dir}" if self.settings.disk_dir else "",
                ", redis" if self.settings.redis_url else "",
            )

    @property
    def _events(self) -> bool:
        return self.kv_events_config.enable_kv_cache_events

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            inner: CPUOffloadingManager | TieredOffloadingManager
            if self.settings.has_lower_tiers:
                with _registry_lock:
                    tiered = _tiered_by_engine.get(self.config.engine_id)
                if tiered is None:
                    raise KVOffloadConfigError(
                        "kv_connector_extra_config['disk_dir'/'redis_url']: lower tiers need "
                        "vLLM's worker in the scheduler's process (one GPU, uniproc executor)"
                    )
                inner = tiered
            else:
                inner = CPUOffloadingManager(
                    self.num_slots, self.settings.cache_policy, enable_events=self._events
                )
            self._manager = KVOffloadManager(
                inner, self.settings.store_threshold, self.settings.max_tracker_size
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self._build_worker(kv_caches)
        return self._worker

    def _build_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        layout, views, _ = plane_layout(kv_caches)
        host_pool = HostPool(layout, self.num_slots, self.blocks_per_chunk, pin_memory=True)
        lower = None
        if self.settings.has_lower_tiers:
            cpu = CPUOffloadingManager(
                self.num_slots, self.settings.cache_policy, enable_events=self._events
            )
            lower = make_lower_tiers(cpu, host_pool, views, layout, **self._tier_args())
            with _registry_lock:
                _tiered_by_engine[self.config.engine_id] = lower.manager
        return KVOffloadWorker(
            layout,
            views,
            host_pool,
            lower,
            recover_failed_loads=self.recover_failed_loads,
            on_shutdown=self.shutdown_tiers if lower is not None else None,
        )

    def _tier_args(self) -> dict[str, Any]:
        s = self.settings
        hash_algo = self.identity.rsplit("hash=", 1)[-1]
        args: dict[str, Any] = {
            "hash_fn": hash_algo,
            "model_id": self.identity,
            "hash_seed": os.environ.get("PYTHONHASHSEED", ""),
            "tp_rank": self.config.parallel.rank,
            "tp_size": self.config.parallel.world_size,
            "disk_dir": s.disk_dir,
            "disk_bytes": s.disk_bytes,
            "redis_url": s.redis_url,
            "write_mode": "write_through" if s.write_through else "write_back",
            "enable_events": self._events,
        }
        accepted = inspect.signature(make_lower_tiers).parameters
        if "model_id" not in accepted:
            # Tiers without an identity input: key them by directory and namespace.
            digest = hashlib.sha256(
                f"{self.identity};rank={self.config.parallel.rank}/"
                f"{self.config.parallel.world_size}".encode()
            ).hexdigest()[:16]
            if s.disk_dir:
                args["disk_dir"] = os.path.join(s.disk_dir, f"vllm-{digest}")
                os.makedirs(args["disk_dir"], exist_ok=True)
            args["redis_namespace"] = f"kvoffload:vllm-{digest}"
        return {k: v for k, v in args.items() if k in accepted}

    def shutdown_tiers(self) -> None:
        """Forget this engine's lower-tier registry entry (worker side closes the stores)."""
        with _registry_lock:
            _tiered_by_engine.pop(self.config.engine_id, None)
