"""``KVOffloadSpec``: kvoffload's tiers as a vLLM ``OffloadingSpec`` (0.32 and 0.33).

vLLM builds one spec on the scheduler side (``get_manager``) and one per
worker rank (``get_worker``), in different processes under vLLM's default
multiprocess executor. Who owns what:

- CPU tier only (no ``disk_dir`` / ``redis_url``): the scheduler side holds
  kvoffload's ``CPUOffloadingManager`` behind ``KVOffloadManager``; each
  worker holds a private host pool of the same number of slots (both sides
  size it from the same config: ``cpu_bytes`` over the offloaded block's
  bytes on all workers), and copies GPU <-> its pool.
- With lower tiers: the scheduler side holds vLLM's tiering manager
  (``KVOffloadTieringManager``) with a CPU primary tier on vLLM's
  ``SharedOffloadRegion`` (``/dev/shm``, mapped whole by the scheduler,
  rank=None) and kvoffload's ``KVOffloadDiskTier`` / ``KVOffloadRedisTier``
  as secondary tiers: every byte between CPU rows and disk / Redis moves in
  the scheduler process, and every piece of tier state lives there. Each
  worker maps its rank's shard of the same region (every row holds all ranks'
  shards) and runs kvoffload's GPU <-> CPU copies over it. Any executor, any
  TP size; nothing is passed between processes but vLLM's own job specs.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.groups.group_kinds import group_layouts
from kvoffload.integrations.vllm.groups.group_slots import (
    GroupSlotPlan,
    group_layout_fingerprint,
    group_name,
    plan_group_slots,
    windowed_groups,
)
from kvoffload.integrations.vllm.groups.window_keep import (
    check_reachable as check_window_keep_reachable,
)
from kvoffload.integrations.vllm.protocols import (
    PrimaryTierView,
    SecondaryTierView,
    SharedRegionView,
)
from kvoffload.integrations.vllm.scheduler.class_managers import ClassedCPUManager
from kvoffload.integrations.vllm.scheduler.connector_build import current_build
from kvoffload.integrations.vllm.scheduler.manager import KVOffloadManager
from kvoffload.integrations.vllm.settings import (
    KVOffloadConfigError,
    KVOffloadSettings,
    parse_settings,
)
from kvoffload.integrations.vllm.worker.shm_lifetime import open_shared_region
from kvoffload.integrations.vllm.worker.worker import KVOffloadWorker, class_pools, plane_layout
from kvoffload.offload import CPUOffloadingManager
from kvoffload.transfer import HostPool, KVLayout, format_bytes

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload")

#: Where ``secondary_tiers`` entries find kvoffload's tier classes.
TIERS_MODULE = "kvoffload.integrations.vllm"


def model_identity(config: OffloadingConfig) -> str:
    """What decides the offloaded bytes besides page geometry: model, dtype, tokens, hash,
    and the KV cache groups (kind, window, layers, bytes per block)."""
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
        f"hash={hash_algo};groups={group_layout_fingerprint(config)}"
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

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's tiering metrics (``vllm:kv_offload_tiering_*``) when lower tiers are set."""
        try:
            settings = parse_settings(extra_config)
        except KVOffloadConfigError:
            return {}  # the engine refuses the config at start-up, with the one line
        if not settings.has_lower_tiers:
            return {}
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        return TieringOffloadingSpec.build_metric_definitions(
            {"secondary_tiers": secondary_tier_configs(settings)}
        )

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33's config-info labels of the tiering manager (CPU tier and each tier)."""
        try:
            settings = parse_settings(extra_config)
        except KVOffloadConfigError:
            return ()
        if not settings.has_lower_tiers:
            return ()
        return compat.tiering_config_info_keys(secondary_tier_configs(settings))

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings: KVOffloadSettings = parse_settings(self.extra_config)
        check_window_keep_reachable(self.extra_config)
        world = max(1, config.parallel.world_size)
        slot_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.tiered = self.settings.has_lower_tiers
        # The shared region's geometry (vLLM's names, read by vLLM's secondary
        # tiers): a row per chunk, holding each rank's page of it in rank order,
        # padded to whole memory pages. One row size for every group: vLLM's
        # tiering manager has one CPU tier and its secondary tiers move whole rows.
        self.cpu_page_size_per_worker = slot_bytes
        self.kv_bytes_per_chunk = _round_up(slot_bytes * world, mmap.PAGESIZE)
        self.all_layers_portable: bool | None = None
        self.num_slots = 0
        #: (group id, kind, window) of each group, when built under KVOffloadConnector.
        build = current_build()
        self.group_descriptions = build.groups if build is not None else None
        #: Slot classes of the KV cache groups (one unless groups' blocks differ in size).
        self.slot_plan: GroupSlotPlan | None = None
        if slot_bytes > 0:
            if self.tiered:
                self.num_slots = self.settings.cpu_bytes // self.kv_bytes_per_chunk
                if self.num_slots < 1:
                    raise KVOffloadConfigError(
                        "kv_connector_extra_config['cpu_bytes']: "
                        f"{format_bytes(self.settings.cpu_bytes)} is smaller than one offloaded "
                        f"block on {world} worker(s) ({self.kv_bytes_per_chunk} bytes)"
                    )
            self.slot_plan = plan_group_slots(
                config,
                self.settings.cpu_bytes,
                self.blocks_per_chunk,
                shared_rows=self.tiered,
                windowed=windowed_groups(config, self.group_descriptions),
            )
            if not self.tiered:
                self.num_slots = sum(c.num_slots for c in self.slot_plan.classes)
        #: vLLM's name for the CPU tier's size in chunks (read by vLLM's tiers).
        self.num_chunks = self.num_slots
        self.identity = model_identity(config)
        #: vLLM's name for the lower tiers' entries: its tiers label their metrics from it
        #: ("1:KVOffloadDiskTier", as vLLM's own series on the same server).
        self.secondary_tier_configs = secondary_tier_configs(self.settings) if self.tiered else []
        self._manager: OffloadingManager | None = None
        self._worker: KVOffloadWorker | None = None
        self._region: SharedRegionView | None = None
        if self.num_slots and self.slot_plan is not None:
            names = [group_name(config, g) for g in range(len(config.groups))]
            logger.info(
                "kvoffload: CPU tier of %d blocks (%s per worker), policy %s%s%s; slots: %s",
                self.num_slots,
                format_bytes(self.settings.cpu_bytes // world),
                self.settings.cache_policy,
                f", disk {self.settings.disk_dir}" if self.settings.disk_dir else "",
                ", redis" if self.settings.redis_url else "",
                self.slot_plan.describe(names),
            )

    @property
    def _events(self) -> bool:
        return self.kv_events_config.enable_kv_cache_events

    # -- scheduler side ------------------------------------------------------------

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.tiered:
                self._manager = self._build_tiering_manager()
            else:
                self._manager = KVOffloadManager(
                    self._cpu_tier(), self.settings.store_threshold, self.settings.max_tracker_size
                )
        return self._manager

    def _cpu_tier(self) -> CPUOffloadingManager | ClassedCPUManager:
        """kvoffload's CPU tier: one manager, or one per slot class (see ``group_slots``)."""
        plan = self.slot_plan
        if plan is None or plan.single:
            layout = None
            if plan is not None and len(self.config.groups) > 1:
                # One slot space for every group: the chunk-unit policy keeps or drops a
                # chunk's keys together and drops windowed keys no hit can reach first.
                per_slot = [plan.slot_bytes(0) * plan.world_size] * len(plan.class_of)
                layout = group_layouts(self.config, self.group_descriptions, per_slot)
            return CPUOffloadingManager(
                self.num_slots,
                self.settings.cache_policy,
                enable_events=self._events,
                group_layout=layout,
            )
        policy, events = self.settings.cache_policy, self._events
        managers = [
            CPUOffloadingManager(c.num_slots, policy, enable_events=events) for c in plan.classes
        ]
        # Keys carry vLLM's group id; the plan is indexed by position in config.groups.
        class_of = [0] * (max(g.group_id for g in self.config.groups) + 1)
        for pos, g in enumerate(self.config.groups):
            class_of[g.group_id] = plan.class_of[pos]
        return ClassedCPUManager(managers, class_of)

    def _build_tiering_manager(self) -> OffloadingManager:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        from kvoffload.integrations.vllm.scheduler.policies import policies_built
        from kvoffload.integrations.vllm.scheduler.tiering import KVOffloadTieringManager

        policy, policy_module = cpu_tier_policy(self.settings)
        poll = {}
        if self.settings.tier_poll_interval_s is not None:
            poll["tier_poll_interval_s"] = self.settings.tier_poll_interval_s
        # Under a lease (shm_lifetime): its /dev/shm name goes once every process mapped it.
        region = open_shared_region(
            self.config.engine_id,
            self.num_slots,
            None,
            self.kv_bytes_per_chunk,
            self.cpu_page_size_per_worker,
            world_size=max(1, self.config.parallel.world_size),
        )
        primary: PrimaryTierView | None = None
        tiers: list[SecondaryTierView] = []
        try:
            with policies_built() as built:
                primary = compat.make_primary_tier(
                    num_chunks=self.num_slots,
                    mmap_region=region,
                    cache_policy=policy,
                    cache_policy_module_path=policy_module,
                    enable_events=self._events,
                    info=compat.cpu_offloading_info(
                        self.config, self.num_slots, self.kv_bytes_per_chunk
                    ),
                )
            view = primary.get_kv_memoryview()
            for tier_config in secondary_tier_configs(self.settings):
                tiers.append(SecondaryTierFactory.create_secondary_tier(tier_config, view, self))
            return KVOffloadTieringManager(
                primary,
                tiers,
                store_threshold=self.settings.store_threshold,
                max_tracker_size=self.settings.max_tracker_size,
                cpu_policy=built[0] if len(built) == 1 else None,
                **compat.tiering_manager_kwargs(KVOffloadTieringManager, **poll),
            )
        except Exception:
            for tier in reversed(tiers):
                try:
                    tier.shutdown()
                except Exception:
                    logger.exception("kvoffload: shutting down a tier after a failed start")
            if primary is not None:
                primary.shutdown()
            else:
                region.cleanup()
            raise

    # -- worker side ---------------------------------------------------------------

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self._build_worker(kv_caches)
        return self._worker

    def _build_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        layout, views, _ = plane_layout(kv_caches)
        plan = self.slot_plan
        if not self.tiered and plan is not None and not plan.single:
            group_pools, routes = class_pools(plan, kv_caches, layout, views)
            return KVOffloadWorker(
                layout,
                views,
                group_pools[0][2],
                recover_failed_loads=self.recover_failed_loads,
                group_pools=group_pools,
                group_routes=routes,
            )
        if not self.tiered:
            host_pool = HostPool(layout, self.num_slots, self.blocks_per_chunk, pin_memory=True)
            return KVOffloadWorker(
                layout, views, host_pool, recover_failed_loads=self.recover_failed_loads
            )
        pools, region = self._shared_host_pools(layout)
        return KVOffloadWorker(
            layout,
            views,
            pools[0],
            recover_failed_loads=self.recover_failed_loads,
            on_shutdown=region.cleanup,
            sub_block_pools=pools,
        )

    def _shared_host_pools(self, layout: KVLayout) -> tuple[list[HostPool], SharedRegionView]:
        """This rank's shard of the shared region: one pool of one-block slots per
        sub-block position of an offloaded block (``blocks_per_chunk`` of them)."""
        region = open_shared_region(
            self.config.engine_id,
            self.num_slots,
            self.config.parallel.rank,
            self.kv_bytes_per_chunk,
            self.cpu_page_size_per_worker,
            world_size=max(1, self.config.parallel.world_size),
        )
        try:
            f = self.blocks_per_chunk
            row = layout.plane_row_bytes
            shape = layout.tensor_shape(self.num_slots)[1:]
            # Per plane: (num_chunks, f * row), rows strided by the region's row.
            areas = [
                region.create_next_worker_view(f * row).view(torch.uint8)
                for _ in range(layout.num_planes)
            ]
            compat.pin_shared_region(region)
            pools = [
                HostPool.over_tensors(
                    layout,
                    [a[:, j * row : (j + 1) * row].view(self.num_slots, *shape) for a in areas],
                    1,
                    pinned=bool(region.is_pinned),
                )
                for j in range(f)
            ]
        except Exception:
            region.cleanup()
            raise
        self._region = region
        return pools, region


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def secondary_tier_configs(settings: KVOffloadSettings) -> list[dict[str, Any]]:
    """``secondary_tiers`` entries (vLLM's tiering format) for the lower tiers in ``settings``."""
    return [dict(entry) for entry in settings.secondary_tiers()]


def cpu_tier_policy(settings: KVOffloadSettings) -> tuple[str, str | None]:
    """vLLM ``CachePolicy`` name and module path for kvoffload's ``cache_policy``.

    kvoffload's policies as vLLM cache policies live in
    ``kvoffload.integrations.vllm.scheduler.policies``; a release of kvoffload without
    that module gives vLLM's "lru" (logged).
    """
    if settings.cache_policy_module_path is not None:
        return settings.vllm_eviction_policy or settings.cache_policy, (
            settings.cache_policy_module_path
        )
    try:
        from kvoffload.integrations.vllm.scheduler import policies
    except ImportError:
        logger.warning(
            "kvoffload: the CPU tier uses vLLM's lru policy (kvoffload's %r is not "
            "available as a vLLM cache policy)",
            settings.cache_policy,
        )
        return "lru", None
    return policies.policy_class_name(settings.cache_policy), policies.__name__
