"""``KVOffloadSpec``'s scheduler side when lower tiers are configured: vLLM's tiering manager.

With ``disk_dir`` / ``redis_url`` the spec's manager is vLLM's own
``TieringOffloadingManager`` (vLLM 0.32 and 0.33 both ship it): a CPU primary
tier over vLLM's ``SharedOffloadRegion`` (``/dev/shm``; the scheduler maps it
whole, each worker rank maps its shard of every row) and kvoffload's disk and
Redis tiers as secondary tiers, which move bytes between the shared rows and
their stores from the scheduler process. So tier state lives in one process
whatever the executor and TP size, and workers only copy GPU <-> their shard.

This subclass adds what ``KVOffloadSpec`` promises beyond vLLM's stock
tiering: ``store_threshold`` (vLLM's tiering spec refuses it; here a block is
offered to the tiers only once it has been offered that many times) and a
tally of the time spent in ``lookup`` on the scheduler thread.

Lookup results (vLLM's tiering semantics, not the CPU-only adapter's):
``HIT`` the primary (CPU) tier holds the block; ``HIT_PENDING`` it is being
written into the CPU tier (a store in flight, or a promotion from disk /
Redis that this or an earlier lookup started); ``RETRY`` a lower tier has
not answered yet (an asynchronous presence check); ``MISS`` no tier has it,
or the CPU tier has no room to promote it. A block that a lower tier loses
between lookup and promotion fails the promotion job: the lookup that
follows is a ``MISS`` and the block is recomputed, never an error.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvoffload.integrations.vllm.scheduler.policies import KVOffloadVLLMPolicy
from kvoffload.integrations.vllm.scheduler.store_threshold import StoreThreshold
from kvoffload.integrations.vllm.tiers.base import KVOffloadTierBase


class KVOffloadTieringManager(TieringOffloadingManager):
    """vLLM's ``TieringOffloadingManager`` with ``store_threshold`` and a lookup-time tally.

    ``store_threshold`` (vLLM's meaning): a block is stored only once it has
    been offered that many times (< 2: always); offers are counted for the
    ``max_tracker_size`` most recently offered keys.
    """

    def __init__(
        self,
        *args: Any,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        cpu_policy: KVOffloadVLLMPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        #: The CPU tier's policy when it is one of kvoffload's (queue and session hints
        #: go to it); kvoffload's record, as vLLM keeps the object it built private.
        self.cpu_policy = cpu_policy
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._threshold = StoreThreshold(store_threshold, max_tracker_size)
        #: Seconds spent inside ``lookup`` (the scheduler thread), and how many calls.
        self.lookup_seconds = 0.0
        self.lookup_calls = 0
        #: Blocks promoted (lookups that started a load into the CPU tier), by tier index.
        self.promotions_by_tier: dict[int, int] = {}

    def lookup(
        self,
        key: OffloadKey,
        req_context: ReqContext,
        *,
        exclude_tier_idx: int | None = None,
    ) -> LookupResult:
        start = time.perf_counter()
        try:
            return super().lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)
        finally:
            self.lookup_seconds += time.perf_counter() - start
            self.lookup_calls += 1

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, req_context: ReqContext) -> bool:
        # vLLM 0.32 and 0.33 both route every promotion through this method.
        started = super()._initiate_promotion(tier_idx, key, req_context)
        if started:
            self.promotions_by_tier[tier_idx] = self.promotions_by_tier.get(tier_idx, 0) + 1
        return started

    def _eligible(self, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        if not self._threshold.active:
            return list(keys)
        return [key for key in keys if self._threshold.offered(key)]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        eligible = self._eligible(keys)
        if not eligible:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        return super().prepare_store(eligible, req_context)

    def reset_cache(self) -> None:
        """vLLM's reset (jobs drained, CPU tier forgotten), then the lower tiers' own reset.

        vLLM leaves secondary tiers as they are; kvoffload's promise for
        ``reset_prefix_cache`` (e.g. new weights under the same name) is that no
        tier serves a block computed before it: the disk tier forgets and
        deletes its blocks, the Redis tier forgets what it knew (the shared
        server keeps them for other instances).
        """
        super().reset_cache()
        self._threshold.clear()
        for tier in self.secondary_tiers:
            if isinstance(tier, KVOffloadTierBase):
                tier.reset_cache()
