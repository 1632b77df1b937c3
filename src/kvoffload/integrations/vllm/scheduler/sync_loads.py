"""Synchronous CPU-tier loads: a hit computed in the engine step it is found.

vLLM's offloading connector loads a hit asynchronously by default: the
request waits in ``WAITING_FOR_REMOTE_KVS`` and is scheduled only once a
later step sees the load finished, so even a load of a few milliseconds costs
one or two engine steps. A small load is cheaper done inside the step: the
connector answers the lookup as *not* asynchronous, the scheduler schedules the
request at once (its loaded blocks count as computed), and the worker finishes
the load before the forward pass.

- vLLM 0.33 has this path natively (``sync_load_budget_bytes``: KV bytes per
  worker that one step may load synchronously; the loads that do not fit stay
  asynchronous). ``KVOffloadConnector`` only gives the key a default.
- vLLM 0.32 has none. ``SyncLoads`` adds it from the outside with the same
  meaning and the same budget: ``reserve`` turns a hit that fits into a
  synchronous one, ``unhashed_view`` lets 0.32's ``update_state_after_alloc``
  find the blocks to load (a synchronous hit's blocks are cached, hence
  hashed, at allocation, and 0.32 looks for the first unhashed block), the
  step's metadata names the synchronous jobs (``SyncLoadMetadata``), and the
  worker waits for them in ``start_load_kv`` and reports no ``finished_recving``
  for them (their requests are already running).

Invariants: the bytes reserved in one step never exceed the budget (estimated
as vLLM 0.33 estimates them: hit tokens x KV bytes per token); a request keeps
at least one token to compute, or it could not be scheduled; a synchronous
load that fails is reported through the same load-failure recovery as an
asynchronous one (vLLM rolls the running request back and recomputes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)

#: KV bytes per worker one engine step may load synchronously, unless configured:
#: about 4 ms of copying at the 16 GB/s of a CPU-engine bulk copy, 2.5 ms over PCIe 4.
DEFAULT_SYNC_LOAD_BUDGET_BYTES = 64 << 20
BUDGET_KEY = "sync_load_budget_bytes"


def kv_bytes_per_token(kv_cache_config: Any, group_ids: Iterable[int]) -> int:
    """KV bytes of one token on one worker, summed over the offloaded groups."""
    total = 0
    for g in group_ids:
        group = kv_cache_config.kv_cache_groups[g]
        spec = group.kv_cache_spec
        # A UniformTypeKVCacheSpecs page already spans every layer of the group.
        layers = 1 if type(spec).__name__ == "UniformTypeKVCacheSpecs" else len(group.layer_names)
        total += spec.page_size_bytes * layers // spec.block_size
    return total


class JobStatusView(Protocol):
    """A job of vLLM 0.32's offloading scheduler (its ``_jobs`` table)."""

    keys: Collection[Any]
    is_store: bool


class RequestStatusView(Protocol):
    @property
    def num_locally_computed_tokens(self) -> int: ...


class OffloadingScheduler032(Protocol):
    """The private state of vLLM 0.32's offloading scheduler that this bridge reads: 0.32
    has no synchronous loads, so they are added from outside (nothing else reads these)."""

    _req_status: Mapping[str, RequestStatusView]
    _current_batch_load_jobs: Collection[int]
    _chunks_being_loaded: set[Any] | None
    _jobs: dict[int, JobStatusView]


@dataclass
class SyncLoadMetadata(OffloadingConnectorMetadata):
    """vLLM 0.32's step metadata plus the ids of the load jobs to finish before the forward."""

    sync_load_jobs: set[int] = field(default_factory=set)


class _Unhashed:
    """A GPU block as 0.32's ``update_state_after_alloc`` reads it, with no hash yet."""

    __slots__ = ("block_id", "is_null")
    block_hash = None

    def __init__(self, block: Any) -> None:
        self.block_id = block.block_id
        self.is_null = block.is_null


class SyncLoads:
    """Scheduler-side bookkeeping of synchronous loads where vLLM has none (0.32).

    One instance per scheduler-side connector; ``end_step`` is called once per
    engine step, after the step's metadata is built.
    """

    def __init__(self, budget_bytes: int, bytes_per_token: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._step_bytes = 0
        self._step_reqs: set[str] = set()
        self._step_jobs: set[int] = set()
        self._in_flight: set[int] = set()  # synchronous jobs not yet reported finished

    def reserve(self, req_id: str, num_computed: int, num_hit: int, num_tokens: int) -> bool:
        """Reserve this step's budget for ``num_hit`` tokens of ``req_id``; False: stay async."""
        self._step_reqs.discard(req_id)  # a lookup repeated in one step replaces the last
        if not self.budget_bytes or not num_hit or num_computed + num_hit >= num_tokens:
            return False
        nbytes = num_hit * self.bytes_per_token
        if self._step_bytes + nbytes > self.budget_bytes:
            return False
        self._step_bytes += nbytes
        self._step_reqs.add(req_id)
        return True

    def is_sync(self, req_id: str) -> bool:
        return req_id in self._step_reqs

    def unhashed_view(
        self, blocks: Any, groups: Sequence[tuple[int, int]], num_local_tokens: int
    ) -> Any:
        """``blocks`` with every block past the locally computed prefix seen as unhashed.

        ``groups``: (group index, tokens per block) of each offloaded group. The
        blocks themselves are untouched: only 0.32's search for the first block
        to load sees the copies.
        """
        out = list(blocks.blocks)
        for group_idx, tokens_per_block in groups:
            first = -(-num_local_tokens // tokens_per_block)
            seq = out[group_idx]
            out[group_idx] = [*seq[:first], *(_Unhashed(b) for b in seq[first:])]
        return type(blocks)(tuple(out))

    def add_job(self, job_id: int) -> None:
        self._step_jobs.add(job_id)
        self._in_flight.add(job_id)

    def alloc_view(
        self,
        sched: OffloadingScheduler032,
        req_id: str,
        blocks: Any,
        groups: Sequence[tuple[int, int]],
    ) -> tuple[Any, set[int]]:
        """For 0.32's ``update_state_after_alloc`` of a synchronous hit: the blocks as it
        must see them (``unhashed_view``) and the load jobs before the call."""
        local = sched._req_status[req_id].num_locally_computed_tokens
        return self.unhashed_view(blocks, groups, local), set(sched._current_batch_load_jobs)

    def claim_new_jobs(self, sched: OffloadingScheduler032, before: set[int]) -> None:
        """After that call: its new load jobs are synchronous, and their chunks are on
        the GPU before this step's forward pass, so other requests may hit them at once
        instead of waiting for the load's report."""
        for job_id in set(sched._current_batch_load_jobs) - before:
            self.add_job(job_id)
            if sched._chunks_being_loaded is not None:
                sched._chunks_being_loaded.difference_update(sched._jobs[job_id].keys)

    @contextlib.contextmanager
    def posing_as_stores(self, sched: OffloadingScheduler032) -> Iterator[None]:
        """Within the block, the synchronous loads still in ``jobs`` (vLLM 0.32's job
        table) look like stores.

        0.32 asserts that a request whose metadata is being built has no load
        pending (it builds a store job, or flushes a preempted request's jobs):
        true of an asynchronous load, whose request is not running, but a
        synchronous load's completion is reported only after the step's forward
        pass, while its request already runs. 0.33 relaxes both assertions for
        its own synchronous loads; nothing else in that call reads the flag.
        """
        jobs = sched._jobs
        self._in_flight &= jobs.keys()
        posed = [jobs[j] for j in self._in_flight if not jobs[j].is_store]
        for status in posed:
            status.is_store = True
        try:
            yield
        finally:
            for status in posed:
                status.is_store = False

    def metadata(self, meta: OffloadingConnectorMetadata) -> OffloadingConnectorMetadata:
        """The step's metadata naming its synchronous jobs (unchanged when there are none)."""
        if not self._step_jobs:
            return meta
        return SyncLoadMetadata(
            load_jobs=meta.load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            sync_load_jobs=set(self._step_jobs),
        )

    def end_step(self) -> None:
        self._step_bytes = 0
        self._step_reqs = set()
        self._step_jobs = set()


def finish_sync_loads(connector_worker: Any, metadata: Any) -> None:
    """Worker side, after the step's loads were submitted: wait for the synchronous ones.

    Their requests already run in this step, so vLLM must not see them in
    ``finished_recving`` (0.32's scheduler asserts a finished load's request
    is waiting or finished): their entries name no request.
    """
    if not isinstance(metadata, SyncLoadMetadata) or not metadata.sync_load_jobs:
        return
    jobs = metadata.sync_load_jobs
    for job_id in jobs:
        connector_worker._load_jobs[job_id] = None
    connector_worker.worker.wait(set(jobs))
