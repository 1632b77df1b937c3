"""vLLM's scheduler-side ``OffloadingManager`` over kvoffload's CPU tier (0.32 and 0.33).

This is the manager of ``KVOffloadSpec`` without lower tiers (with ``disk_dir``
or ``redis_url`` the spec builds vLLM's tiering manager over kvoffload's tiers
instead, see ``tiering``). vLLM asks about one key at a time
(``lookup(key, ctx)``) and answers with a ``LookupResult``:

- ``HIT``: the CPU tier holds the block;
- ``HIT_PENDING``: the block is being stored into the CPU tier: found, not
  readable yet. vLLM retries the request next step;
- ``MISS``: the CPU tier does not have it.

vLLM completes jobs by key *set* (``complete_load(set(keys))``); kvoffload's
manager matches a completion to its ``prepare_*`` call by key order.
Each prepared job is recorded under its ``frozenset`` so that the ordered
keys and the job's outcome can be passed on. The outcome comes from the
worker through ``note_failed`` (``KVOffloadConnector`` forwards it); without
it every job counts as successful, which vLLM's stock connector guarantees
anyway by asserting on every transfer result.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Protocol

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.protocols import GroupOffloadConfigView
from kvoffload.integrations.vllm.scheduler.class_managers import ClassedCPUManager
from kvoffload.integrations.vllm.scheduler.store_threshold import StoreThreshold
from kvoffload.offload import CPULoadStoreSpec, CPUOffloadingManager
from kvoffload.offload.base import LoadStoreSpec as KVLoadStoreSpec

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload")


class KVOffloadJobSpec(LoadStoreSpec):
    """What vLLM carries from the manager to the worker: kvoffload's spec and a job tag.

    ``op_id`` names the ``prepare_load``/``prepare_store`` call, so the worker
    can report which one failed.
    """

    def __init__(self, inner: KVLoadStoreSpec, op_id: int) -> None:
        #: kvoffload's spec of the CPU tier's slots (a ``CPULoadStoreSpec``).
        self.inner = inner
        self.op_id = op_id

    def __repr__(self) -> str:
        return f"KVOffloadJobSpec(op={self.op_id}, {self.inner!r})"


@dataclass
class _Op:
    op_id: int
    keys: list[OffloadKey]


#: ``kv_transfer_params`` key of the session hint: ``{"kvoffload_continues": true}`` on a
#: request says its conversation will continue, so its blocks are announced with
#: ``hint_continues`` when it finishes (a soft priority in the CPU tier's policy).
CONTINUES_PARAM = "kvoffload_continues"


def request_offload_keys(
    block_hashes: Sequence[bytes], group_configs: Iterable[GroupOffloadConfigView]
) -> list[OffloadKey]:
    """The offload keys of a request's full chunks, group after group, each group head first.

    ``group_configs`` are vLLM's ``GroupOffloadConfig`` (``group_idx``,
    ``hashes_per_chunk``): a chunk's key is the hash of its last block, as
    vLLM's offloading scheduler keys it. Costs O(len(block_hashes)) per group.
    """
    keys: list[OffloadKey] = []
    for group in group_configs:
        step = int(group.hashes_per_chunk)
        # The group's key suffix, checked once (make_offload_key of an empty hash): the
        # keys are made for every full chunk of every waiting request, 16 K-token prompts
        # included, so one call per key showed in the scheduler's profile.
        suffix = make_offload_key(b"", int(group.group_idx))
        chunk_hashes = block_hashes[step - 1 :: step]
        keys.extend([bytes(h) + suffix for h in chunk_hashes])
    return keys


@dataclass
class _RequestHints:
    """What the queue and session hints know of one live request."""

    continues: bool = False
    #: Its full chunks' keys (announced at arrival, plus what it stored when it continues).
    keys: list[OffloadKey] = field(default_factory=list)


class HintTarget(Protocol):
    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None: ...
    def hint_dequeued(self, request_id: str) -> None: ...
    def hint_continues(self, keys: Sequence[OffloadKey]) -> None: ...


class RequestHints:
    """The queue and session hints of vLLM's requests, sent to ``target`` (issue 20).

    ``target`` is a kvoffload manager (``KVOffloadManager``'s) or a kvoffload
    policy inside vLLM's own CPU tier (``KVOffloadVLLMPolicy``, under vLLM's
    tiering manager). A request is announced with ``hint_queued`` while it
    waits: from its arrival (``queued``) to its first scheduling or resumption
    (``scheduled``), again after each preemption (``preempted``); its finish or
    abort (``finished``) ends that and, for a request whose
    ``kv_transfer_params`` hold ``{CONTINUES_PARAM: true}``, announces its
    blocks with ``hint_continues``. Every method is idempotent (the manager's
    hooks and the connector may both report an event) and costs O(keys of the
    request).
    """

    def __init__(self, target: HintTarget) -> None:
        self.target = target
        self._live: dict[str, _RequestHints] = {}
        self._queued: set[str] = set()

    def arrived(self, req_id: str, kv_transfer_params: Mapping[str, Any] | None) -> None:
        """vLLM saw the request (``on_new_request``); a second report changes nothing."""
        if req_id not in self._live:
            continues = (kv_transfer_params or {}).get(CONTINUES_PARAM) is True
            self._live[req_id] = _RequestHints(continues=continues)

    def queued(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """The request waits in vLLM's queue; ``keys``: its full chunks' keys, head first."""
        hints = self._live.get(req_id)
        if hints is None:
            return
        hints.keys = list(keys)
        self._queued.add(req_id)
        self.target.hint_queued(req_id, hints.keys)

    def scheduled(self, req_ids: Iterable[str]) -> None:
        """These requests left the waiting queue (first scheduled, or resumed)."""
        queued = self._queued
        for req_id in req_ids:
            if req_id in queued:
                queued.discard(req_id)
                self.target.hint_dequeued(req_id)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """These requests went back to the waiting queue: announce them again."""
        for req_id in req_ids:
            hints = self._live.get(req_id)
            if hints is not None and hints.keys and req_id not in self._queued:
                self._queued.add(req_id)
                self.target.hint_queued(req_id, hints.keys)

    def stored(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """The request stored ``keys``: part of its session hint if it continues."""
        hints = self._live.get(req_id)
        if hints is not None and hints.continues and keys:
            hints.keys.extend(keys)

    def finished(self, req_id: str) -> None:
        """The request finished or was aborted."""
        if req_id in self._queued:
            self._queued.discard(req_id)
            self.target.hint_dequeued(req_id)
        hints = self._live.pop(req_id, None)
        if hints is not None and hints.continues and hints.keys:
            self.target.hint_continues(list(dict.fromkeys(hints.keys)))

    def num_queued(self) -> int:
        """Requests announced as waiting and not yet dequeued."""
        return len(self._queued)


class KVOffloadManager(OffloadingManager):
    """vLLM's manager API over kvoffload's ``CPUOffloadingManager`` (the CPU tier).

    ``store_threshold`` (vLLM's meaning): a block is stored only once it has
    been offered that many times (< 2: always); offers are counted for the
    ``max_tracker_size`` most recently offered keys.
    """

    def __init__(
        self,
        inner: CPUOffloadingManager | ClassedCPUManager,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
    ) -> None:
        if not isinstance(inner, CPUOffloadingManager | ClassedCPUManager):
            raise TypeError(f"expected kvoffload's CPUOffloadingManager, got {type(inner)}")
        self.inner = inner
        self.cpu = inner
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._threshold = StoreThreshold(store_threshold, max_tracker_size)
        self._op_ids = count()
        self._loads: dict[frozenset[OffloadKey], deque[_Op]] = {}
        self._stores: dict[frozenset[OffloadKey], deque[_Op]] = {}
        self._failed: set[int] = set()
        self.failed_loads = 0
        self.failed_stores = 0
        #: Queue and session hints of vLLM's requests, for the tiers (see the "hints" section).
        self.hints = RequestHints(inner)

    # -- lookups ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        cpu = self.cpu
        if cpu.is_stored(key):
            return LookupResult.HIT
        if cpu.is_storing(key):
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        # Every block this manager loads comes from host memory; vLLM's default
        # ("external_unspecified") is for managers that cannot tell.
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        ordered = list(keys)
        op = _Op(next(self._op_ids), ordered)
        inner = self.inner.prepare_load(ordered)
        self._loads.setdefault(frozenset(ordered), deque()).append(op)
        return KVOffloadJobSpec(inner, op.op_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.inner.touch(list(keys))

    def note_failed(self, op_ids: Iterable[int]) -> None:
        """Jobs the worker could not complete (reported before their ``complete_*`` call)."""
        self._failed.update(op_ids)

    def _pop(
        self, table: dict[frozenset[OffloadKey], deque[_Op]], keys: Collection[OffloadKey]
    ) -> tuple[_Op | None, bool]:
        key_set = frozenset(keys)
        queue = table.get(key_set)
        if not queue:
            return None, True
        # Of equal key sets in flight, settle a failed one first: vLLM
        # completes jobs by key set, and only a failure changes the outcome.
        op = next((o for o in queue if o.op_id in self._failed), queue[0])
        queue.remove(op)
        if not queue:
            del table[key_set]
        ok = op.op_id not in self._failed
        self._failed.discard(op.op_id)
        return op, ok

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        op, ok = self._pop(self._loads, keys)
        if op is None:
            raise ValueError(f"complete_load of {len(keys)} keys that no prepare_load pinned")
        if not ok:
            self.failed_loads += 1
        self.cpu.complete_load(op.keys)

    # -- stores ----------------------------------------------------------------

    def _eligible(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        if not self._threshold.active:
            return keys
        cpu = self.cpu
        return [
            key
            for key in keys
            if cpu.is_stored(key) or cpu.is_storing(key) or self._threshold.offered(key)
        ]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        ordered = self._eligible(list(dict.fromkeys(keys)))
        if ordered:
            # The tier's admission: a declined block is not stored (vLLM stores only
            # keys_to_store, as with its own store_threshold), so it takes no slot.
            flags = self.inner.admit(ordered)
            if flags is not None:
                ordered = [k for k, f in zip(ordered, flags) if f]
        if not ordered:
            return PrepareStoreOutput([], KVOffloadJobSpec(CPULoadStoreSpec([]), -1), [])
        out = self.inner.prepare_store(ordered)
        if out is None:
            return None
        stored = list(out.keys_to_store)
        self.hints.stored(req_context.req_id, stored)
        if stored:
            op = _Op(next(self._op_ids), stored)
            self._stores.setdefault(frozenset(stored), deque()).append(op)
            spec = KVOffloadJobSpec(out.store_spec, op.op_id)
        else:
            spec = KVOffloadJobSpec(out.store_spec, -1)
        return PrepareStoreOutput(stored, spec, list(out.evicted_keys))

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        op, ok = self._pop(self._stores, keys)
        if op is None:
            # vLLM may complete keys that were already stored: nothing to settle.
            return
        ok = ok and success
        if not ok:
            self.failed_stores += 1
        self.inner.complete_store(op.keys, success=ok)

    # -- lifecycle ---------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.hints.arrived(req_context.req_id, req_context.kv_transfer_params)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.hints.finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.hints.scheduled(context.new_req_ids)
        self.hints.preempted(context.preempted_req_ids)

    # -- hints (issue 20): the waiting queue and session continuations -------------
    #
    # vLLM tells the manager when a request arrives (on_new_request), is first
    # scheduled or preempted (on_schedule_end) and finishes or is aborted
    # (on_request_finished), but not its block hashes at arrival nor its
    # resumption after a preemption: KVOffloadConnector reports those
    # (``request_queued``, ``requests_scheduled``). Behind vLLM's stock
    # OffloadingConnector no queue hint is sent (there are no keys to
    # announce); the session hint still covers the keys the request stores.

    def request_queued(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """Request ``req_id`` waits in vLLM's queue; ``keys`` are its full chunks' keys.

        Announced to the tiers with ``hint_queued`` (O(len(keys))); ended by the
        request's first scheduling, its resumption or its finish. A request the
        manager has not seen through ``on_new_request`` is ignored.
        """
        self.hints.queued(req_id, keys)

    def requests_scheduled(self, req_ids: Iterable[str]) -> None:
        """These requests left the waiting queue (scheduled, new or resumed)."""
        self.hints.scheduled(req_ids)

    def num_queued_hints(self) -> int:
        """Requests announced as waiting and not yet dequeued."""
        return self.hints.num_queued()

    def take_events(self) -> Iterator[OffloadingEvent]:
        """The CPU tier's events, as vLLM's primary tier spells them (``Medium.CPU``)."""
        for ev in self.inner.take_events():
            yield OffloadingEvent(keys=list(ev.keys), medium=Medium.CPU, removed=ev.removed)

    def reset_cache(self) -> None:
        """Forget every block of every tier (vLLM: ``reset_prefix_cache``, e.g. new weights).

        vLLM drops the jobs in flight at a reset (it never completes them, and
        makes the workers finish them before any new job runs), so the tiers
        are reset with ``force`` and the adapter forgets those jobs too.
        """
        self.inner.reset_cache(force=True)
        self._loads.clear()
        self._stores.clear()
        self._failed.clear()
        self._threshold.clear()

    def num_in_flight(self) -> int:
        """Loads and stores prepared whose ``complete_*`` has not come yet."""
        return sum(len(q) for q in self._loads.values()) + sum(
            len(q) for q in self._stores.values()
        )
