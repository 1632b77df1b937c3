"""``KVOffloadConnector``: vLLM's offloading connector with ``KVOffloadSpec`` preselected.

Beyond the stock connector it wires vLLM 0.33's load-failure recovery: the
worker reports a failed load's GPU blocks through
``get_block_ids_with_load_errors`` (vLLM recomputes them under
``kv_load_failure_policy="recompute"``) and the failed jobs' tags travel to
the scheduler side in the worker metadata, so the manager drops what the
failed job touched instead of offering it again.

It also computes a CPU-tier hit in the step it is found when the load fits
the step's budget (``sync_load_budget_bytes``, default
``DEFAULT_SYNC_LOAD_BUDGET_BYTES`` without async scheduling, 0 with it; 0
turns it off): natively on vLLM 0.33,
through ``sync_loads.SyncLoads`` on 0.32, which has no such path. A
synchronous load that fails goes to the same recovery as an asynchronous one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.integrations.vllm.compat import manager_lock, native_sync_loads
from kvoffload.integrations.vllm.groups.group_kinds import check_offloadable
from kvoffload.integrations.vllm.groups.window_keep import install_window_keep
from kvoffload.integrations.vllm.protocols import (
    KVCacheConfigView,
    RequestView,
    SchedulerOutputView,
    VllmConfigView,
)
from kvoffload.integrations.vllm.scheduler.connector_build import connector_build
from kvoffload.integrations.vllm.scheduler.manager import (
    KVOffloadManager,
    RequestHints,
    request_offload_keys,
)
from kvoffload.integrations.vllm.scheduler.sync_loads import (
    BUDGET_KEY,
    DEFAULT_SYNC_LOAD_BUDGET_BYTES,
    SyncLoadMetadata,
    SyncLoads,
    finish_sync_loads,
    kv_bytes_per_token,
)
from kvoffload.integrations.vllm.scheduler.tiering import KVOffloadTieringManager
from kvoffload.integrations.vllm.settings import KVOffloadConfigError
from kvoffload.integrations.vllm.spec import KVOffloadSpec
from kvoffload.integrations.vllm.worker.layer_loads import layer_extents
from kvoffload.integrations.vllm.worker.worker import KVOffloadWorker

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload")

SPEC_NAME = "KVOffloadSpec"
SPEC_MODULE = "kvoffload.integrations.vllm"


@dataclass
class KVOffloadWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus the tags of the manager jobs that failed."""

    failed_ops: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = set(self.failed_ops)
        if isinstance(other, KVOffloadWorkerMetadata):
            failed |= other.failed_ops
        return KVOffloadWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_ops=failed,
        )


def select_spec(extra_config: dict[str, Any]) -> None:
    """Point ``extra_config`` at ``KVOffloadSpec``; another spec is a start-up error."""
    for key, value in (("spec_name", SPEC_NAME), ("spec_module_path", SPEC_MODULE)):
        given = extra_config.get(key, value)
        if given != value:
            raise KVOffloadConfigError(
                f"kv_connector_extra_config[{key!r}]: KVOffloadConnector uses {value!r}, "
                f"got {given!r} (use vLLM's OffloadingConnector for other specs)"
            )
        extra_config[key] = value


class KVOffloadConnector(OffloadingConnector):
    """``"kv_connector": "KVOffloadConnector"``, ``"kv_connector_module_path":
    "kvoffload.integrations.vllm"``; extra-config keys as ``KVOffloadSpec``'s."""

    def __init__(
        self, vllm_config: VllmConfigView, role: object, kv_cache_config: KVCacheConfigView
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "a KV connector is built from a kv_transfer_config"
        if transfer.kv_connector_extra_config is None:
            transfer.kv_connector_extra_config = {}
        extra = transfer.kv_connector_extra_config
        select_spec(extra)
        #: Queue and session hints for the CPU tier's policy under vLLM's tiering manager.
        self._tier_hints: RequestHints | None = None
        # vLLM's offloading refuses these layouts deep in its start-up: one line instead.
        check_offloadable(kv_cache_config)
        # Before vLLM reads it (0.33's scheduler config takes it at construction).
        # Not by default under async scheduling: there vLLM 0.33 never releases
        # the output placeholder of a request whose synchronous load failed, and
        # the request hangs (see tests/integrations/test_vllm_load_failure.py).
        if not vllm_config.scheduler_config.async_scheduling:
            extra.setdefault(BUDGET_KEY, DEFAULT_SYNC_LOAD_BUDGET_BYTES)
        # The spec vLLM builds in there learns the groups' kinds (it sees only their
        # windows) and that KVOffloadConnector's hooks are present.
        with connector_build(kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            spec = self.connector_worker.spec
            assert isinstance(spec, KVOffloadSpec)
            spec.recover_failed_loads = True
        #: Synchronous loads added from outside (vLLM 0.32); None where vLLM has them.
        self.sync_loads: SyncLoads | None = None
        sched = self.connector_scheduler
        if sched is not None and not native_sync_loads(sched):
            self.emulate_sync_loads(int(extra.get(BUDGET_KEY, 0)), kv_cache_config)
        #: Extra sliding-window stores (``window_keep``, opt-in); None when off.
        self.window_keep = install_window_keep(sched, extra) if sched is not None else None

    def emulate_sync_loads(self, budget_bytes: int, kv_cache_config: KVCacheConfigView) -> None:
        """Synchronous loads through ``SyncLoads`` (vLLM 0.32's path; on 0.33, tests
        call it to run that path, which turns vLLM's own off)."""
        sched = self.connector_scheduler
        assert sched is not None
        if native_sync_loads(sched):
            sched.config = sched.config._replace(sync_load_budget_bytes=0)
        groups = [g.group_idx for g in sched.config.kv_group_configs]
        self.sync_loads = SyncLoads(budget_bytes, kv_bytes_per_token(kv_cache_config, groups))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: Any,
        per_engine_labelvalues: Any,
    ) -> Any:
        # The frontend builds these from the config alone, without an instance:
        # point it at KVOffloadSpec there too, or it would describe vLLM's CPU spec.
        transfer = vllm_config.kv_transfer_config
        if transfer is not None:
            if transfer.kv_connector_extra_config is None:
                transfer.kv_connector_extra_config = {}
            select_spec(transfer.kv_connector_extra_config)
        return super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # -- worker side -------------------------------------------------------------

    @property
    def kvoffload_worker(self) -> KVOffloadWorker | None:
        """The worker running this connector's transfers (after ``register_kv_caches``)."""
        if self.connector_worker is None:
            return None
        worker = self.connector_worker.worker
        return worker if isinstance(worker, KVOffloadWorker) else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.kvoffload_worker
        if worker is not None and worker.stage_by_layer(layer_extents(kv_caches)):
            logger.info(
                "kvoffload: synchronous loads are copied layer by layer where the forward "
                "pass leaves a core to the copy (this engine: %s)",
                "yes" if worker.stages_now() else "no, they are copied whole before it",
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self.kvoffload_worker
        if worker is not None:
            worker.before_layer(layer_name)

    def wait_for_save(self) -> None:
        worker = self.kvoffload_worker
        if worker is not None:
            worker.end_forward()
        super().wait_for_save()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        worker = self.kvoffload_worker
        if isinstance(meta, SyncLoadMetadata) and meta.sync_load_jobs and worker is not None:
            worker.expedite(meta.sync_load_jobs)
        super().start_load_kv(forward_context, **kwargs)
        # vLLM 0.32: the step's synchronous loads finish before the forward pass
        # (0.33 waits for its own in start_kv_transfers).
        finish_sync_loads(self.connector_worker, self._connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.kvoffload_worker
        return worker.take_load_error_blocks() if worker is not None else set()

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self.kvoffload_worker
        failed = worker.take_failed_ops() if worker is not None else set()
        if not failed:
            return meta
        base = meta if meta is not None else OffloadingWorkerMetadata()
        return KVOffloadWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            failed_ops=failed,
        )

    # -- scheduler side ----------------------------------------------------------

    @property
    def kvoffload_manager(self) -> KVOffloadManager | None:
        """The scheduler side's manager adapter."""
        if self.connector_scheduler is None:
            return None
        manager = self.connector_scheduler.manager
        return manager if isinstance(manager, KVOffloadManager) else None

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        sync = self.sync_loads
        if (
            sync is not None
            and hit is not None
            and sync.reserve(request.request_id, num_computed_tokens, hit, request.num_tokens)
        ):
            return hit, False
        return hit, is_async

    def update_state_after_alloc(
        self, request: RequestView, blocks: Any, num_external_tokens: int
    ) -> None:
        sync, sched = self.sync_loads, self.connector_scheduler
        if (
            sync is None
            or sched is None
            or not num_external_tokens
            or not sync.is_sync(request.request_id)
        ):
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        groups = [(g.group_idx, g.tokens_per_block) for g in sched.config.kv_group_configs]
        view, before = sync.alloc_view(sched, request.request_id, blocks, groups)
        super().update_state_after_alloc(request, view, num_external_tokens)
        sync.claim_new_jobs(sched, before)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = self.kvoffload_manager
        if isinstance(meta, KVOffloadWorkerMetadata) and manager is not None:
            manager.note_failed(meta.failed_ops)
        super().update_connector_output(connector_output)

    # -- queue hints (issue 20): what the manager cannot see by itself ---------------

    def _request_hints(self) -> tuple[RequestHints, Any] | None:
        """Where queue and session hints go (with the manager whose lock guards it), or None.

        The CPU-only adapter keeps its own ``RequestHints``; under vLLM's tiering
        manager (lower tiers) they go to the CPU tier's policy when it is one of
        kvoffload's (``KVOffloadVLLMPolicy``).
        """
        if self.connector_scheduler is None:
            return None
        manager = self.connector_scheduler.manager
        if isinstance(manager, KVOffloadManager):
            return manager.hints, manager
        if not isinstance(manager, KVOffloadTieringManager) or manager.cpu_policy is None:
            return None
        if self._tier_hints is None:
            self._tier_hints = RequestHints(manager.cpu_policy)
        return self._tier_hints, manager

    def on_new_request(self, request: RequestView) -> None:
        super().on_new_request(request)
        target = self._request_hints()
        if target is None:
            return
        hints, manager = target
        assert self.connector_scheduler is not None
        groups = self.connector_scheduler.config.kv_group_configs
        keys = request_offload_keys(request.block_hashes, groups)
        with manager_lock(manager):
            hints.arrived(request.request_id, request.kv_transfer_params)
            hints.queued(request.request_id, keys)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> Any:
        sync = self.sync_loads
        if sync is None:
            meta = super().build_connector_meta(scheduler_output)
        else:
            assert self.connector_scheduler is not None
            with sync.posing_as_stores(self.connector_scheduler):
                meta = super().build_connector_meta(scheduler_output)
            meta = sync.metadata(meta)
            sync.end_step()
        target = self._request_hints()
        if target is not None:
            # After the step's region: the manager's lock is free again. The
            # CPU-only adapter has seen all but resumptions in its own hooks
            # (RequestHints ignores what it already knows).
            hints, manager = target
            with manager_lock(manager):
                hints.scheduled(r.req_id for r in scheduler_output.scheduled_new_reqs)
                hints.scheduled(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
                hints.preempted(scheduler_output.preempted_req_ids or ())
                for req_id in scheduler_output.finished_req_ids or ():
                    hints.finished(req_id)
        return meta
