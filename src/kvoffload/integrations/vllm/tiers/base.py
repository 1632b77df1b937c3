"""What kvoffload's disk and Redis tiers share as vLLM secondary tiers.

vLLM's ``TieringOffloadingManager`` (0.32 and 0.33) calls a secondary tier
from the scheduler process, under its lock, and expects every call to return
at once. This base class gives a tier exactly that:

- ``submit_store`` / ``submit_load`` do the tier's bookkeeping (slots,
  pins, eviction) on the calling thread and queue the bytes for the tier's
  own I/O threads; they never wait for I/O;
- the I/O threads move bytes between vLLM's shared CPU rows
  (``primary_kv_view``: one row per primary chunk, holding every rank's shard,
  so the tier is oblivious of TP size and executor) and the store, loads
  before stores;
- ``get_finished_jobs`` applies what the threads finished (on the scheduler
  thread again) and reports ``JobResult``s with ``transfer_time`` (seconds
  the I/O took, queueing excluded) and ``transfer_bytes``, which vLLM's
  tiering metrics record per tier and its backpressure detector
  (``bp_detector``, driven by the tiering manager from these results) reads;
- a promotion in which some blocks could not be read (gone, corrupt, server
  down) reports ``success=False`` with ``successful_keys`` = the blocks that
  were read: vLLM frees the others' primary slots and the request recomputes
  them; a tier never raises for a vanished block.

Write-back: vLLM's tiering cascades every block to every secondary tier as
soon as it is in the CPU tier (``complete_store``), and a secondary tier sees
neither the CPU tier's evictions nor their bytes (the slot is reused at
once), so kvoffload's write-back mode (lower tiers written only with what
the CPU tier evicts) cannot be offered inside vLLM's tiering: these tiers
are write-through. ``write_mode: "write_back"`` is refused at start-up with
that reason; vLLM's backpressure policies are the way to shed writes.

Identity (``identity.tier_identity``), the keys of a tier's entry
(``keys.split_keys``), its metrics (``metrics``) and the I/O threads
(``io_threads``) live beside this file.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvoffload.integrations.vllm import log_bridge
from kvoffload.integrations.vllm.tiers.identity import tier_identity, tier_label_of
from kvoffload.integrations.vllm.tiers.io_threads import IOJob, IOThreads
from kvoffload.integrations.vllm.tiers.keys import split_keys
from kvoffload.integrations.vllm.tiers.metrics import STORES_DROPPED, metric_definitions
from kvoffload.tiers.config import TierConfig

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

# Under "vllm." so that vLLM's logging configuration shows these lines; the core tiers'
# own lines (kvoffload.tiers.*: a server unreachable or back, a full disk, dropped
# blocks) reach vLLM's handlers through the bridge.
logger = logging.getLogger("vllm.kvoffload.tiers")
log_bridge.install()


# -- the tier ---------------------------------------------------------------------------


class KVOffloadTierBase(SecondaryTierManager):
    """kvoffload's shared secondary-tier machinery (module docstring); see the two tiers.

    Subclasses set ``DEFAULT_LOCALITY`` and implement ``_lookup``,
    ``_begin_store`` / ``_begin_load`` (scheduler thread: bookkeeping; return
    the ``IOJob``, or for a store True when nothing needs writing and False
    when the tier drops it), ``_run_io`` (an I/O
    thread: the bytes, per-key success), ``_end_job`` (scheduler thread:
    bookkeeping after the I/O) and ``_close_store``.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    DEFAULT_LOCALITY: ClassVar[Locality] = Locality.LOCAL

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None,
        tier_config: TierConfig,
        own_keys: Mapping[str, Any],
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        #: kvoffload's record of the spec (vLLM keeps its own reference private).
        self.offloading_spec = offloading_spec
        self.tier_config = tier_config
        self.locality = own_keys.get("locality", self.DEFAULT_LOCALITY)
        # A shared tier's id in its KV events (the Redis tier's namespace); None: not shared.
        self.event_ownership: str | None = None
        self.label = tier_label_of(offloading_spec, tier_type)
        self.row_bytes = self.block_size_bytes
        num_rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        # A flat byte view of its own: our numpy arrays export the cast view, not
        # vLLM's, so vLLM can release its memoryview at shutdown.
        self._flat: memoryview | None = primary_kv_view.cast("B")
        self._rows: np.ndarray | None = np.frombuffer(self._flat, dtype=np.uint8).reshape(
            num_rows, self.row_bytes
        )
        self.identity = tier_identity(
            offloading_spec, self.row_bytes, own_keys.get("model_revision")
        )
        self._events_on = bool(
            tier_config.enable_events and offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self._events: list[OffloadingEvent] = []
        self._pending: dict[JobId, IOJob] = {}
        self._ready: list[JobResult] = []
        self._counters: dict[str, int] = {}
        self._io = IOThreads(
            f"kvoffload-{type(self).__name__}", tier_config.num_threads, self._run_io
        )
        self._closed = False
        #: Seconds the scheduler thread spent in this tier's ``lookup``, and the calls.
        self.lookup_seconds = 0.0
        self.lookup_calls = 0

    # -- subclass hooks --------------------------------------------------------------

    def _lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        raise NotImplementedError

    def _begin_store(
        self, job: TransferJob, keys: list[OffloadKey], chunks: list[int]
    ) -> IOJob | bool:
        raise NotImplementedError

    def _begin_load(self, job: TransferJob, keys: list[OffloadKey], chunks: list[int]) -> IOJob:
        raise NotImplementedError

    def _run_io(self, job: IOJob) -> Sequence[bool]:
        raise NotImplementedError

    def _end_job(self, job: IOJob) -> None:
        raise NotImplementedError

    def _close_store(self) -> None:
        raise NotImplementedError

    def reset_cache(self) -> None:
        """Forget the tier's blocks at vLLM's ``reset_prefix_cache`` (called by
        ``KVOffloadTieringManager``; vLLM's own reset leaves secondary tiers alone).
        Nothing by default."""

    def _gauges(self) -> dict[str, float]:
        return {}

    # -- helpers for subclasses ------------------------------------------------------

    def rows(self, chunks: Sequence[int]) -> list[np.ndarray]:
        """The primary rows of ``chunks`` (views into vLLM's shared region, no copy)."""
        assert self._rows is not None, "tier is shut down"
        return [self._rows[c] for c in chunks]

    def copy_rows(self, chunks: Sequence[int]) -> np.ndarray:
        """A copy of the primary rows of ``chunks``, one row each."""
        assert self._rows is not None, "tier is shut down"
        return np.take(self._rows, list(chunks), axis=0)

    def count(self, name: str, n: int = 1) -> None:
        if n:
            self._counters[name] = self._counters.get(name, 0) + n

    def emit(self, keys: Iterable[OffloadKey], removed: bool) -> None:
        keys = list(keys)
        if keys and self._events_on:
            self._events.append(
                OffloadingEvent(
                    keys=keys,
                    medium=self.medium,
                    removed=removed,
                    locality=self.locality,
                    ownership=self.event_ownership,
                )
            )

    def finish_now(
        self, job_id: JobId, success: bool, successful: Collection[OffloadKey] | None = None
    ) -> None:
        """Report a job that needed no I/O at the next ``get_finished_jobs``."""
        self._ready.append(
            JobResult(
                job_id=job_id,
                success=success,
                successful_keys=tuple(successful) if successful else None,
                transfer_time=0.0,
                transfer_bytes=0,
            )
        )

    # -- vLLM's SecondaryTierManager -------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        start = time.perf_counter()
        try:
            return self._lookup(key, req_context)
        finally:
            self.lookup_seconds += time.perf_counter() - start
            self.lookup_calls += 1

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        if self._closed:
            self.count(STORES_DROPPED, len(keys))
            self.finish_now(job_metadata.job_id, False)
            return
        io = self._begin_store(job_metadata, keys, chunks)
        if isinstance(io, bool):
            # No I/O: nothing new to write (True) or a store the tier drops (False,
            # which vLLM's backpressure detector sees as a failed store).
            self.finish_now(job_metadata.job_id, io)
            return
        self._pending[io.job_id] = io
        self._io.submit(io)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        if self._closed:
            self.finish_now(job_metadata.job_id, False)
            return
        io = self._begin_load(job_metadata, keys, chunks)
        io.job_keys = keys
        if not io.keys:
            io.ok = []
            self._finish(io)
            return
        self._pending[io.job_id] = io
        self._io.submit(io)

    def _finish(self, io: IOJob) -> None:
        """Turn a finished ``IOJob`` into its ``JobResult`` (scheduler thread)."""
        self._end_job(io)
        nbytes = self.row_bytes * sum(io.ok)
        if io.is_load:
            good = {k for k, ok in zip(io.keys, io.ok) if ok}
            successful = [k for k in io.job_keys if k in good]
            success = len(successful) == len(io.job_keys)
            result = JobResult(
                job_id=io.job_id,
                success=success,
                successful_keys=None if success or not successful else tuple(successful),
                transfer_time=io.seconds,
                transfer_bytes=nbytes,
            )
        else:
            result = JobResult(
                job_id=io.job_id,
                success=all(io.ok),
                transfer_time=io.seconds,
                transfer_bytes=nbytes,
            )
        if io.error:
            logger.debug("kvoffload tier %s job %d: %s", self.label, io.job_id, io.error)
        self._ready.append(result)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = self._io.finished
        while finished:
            io = finished.popleft()
            self._pending.pop(io.job_id, None)
            self._finish(io)
        out, self._ready = self._ready, []
        return out

    def has_pending_work(self) -> bool:
        return bool(self._pending or self._ready or self._io.finished)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        self._io.wait_idle()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._io.stop()
            self._close_store()
        finally:
            # Drop every view of vLLM's region so it can unmap it. A store call that
            # failed (a dead server) can leave a reference cycle (exception, traceback,
            # frames) holding a row view: collect it, or vLLM keeps the region mapped.
            self._rows = None
            gc.collect()
            if self._flat is not None:
                self._flat.release()
                self._flat = None

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        labels = (self.label,)
        for name, n in self._counters.items():
            stats.increase_counter(name, n, labels)
        self._counters.clear()
        for name, value in self._gauges().items():
            stats.set_gauge(name, value, labels)
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33's config-info labels of this tier: none."""
        return ()

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        return {}

    # -- introspection (tests, benchmarks) ---------------------------------------------

    def counters(self) -> dict[str, int]:
        """Counts since the last ``get_stats`` (which resets them)."""
        return dict(self._counters)

    def gauges(self) -> dict[str, float]:
        return self._gauges()


# -- a tier over one store, built from its ``secondary_tiers`` entry --------------------------


class KVOffloadStoreTier(KVOffloadTierBase):
    """The constructor kvoffload's tiers share (vLLM's ``SecondaryTierFactory`` calls it).

    A subclass names its entry's keys (``TIER_KEYS``: ``TierConfig`` fields,
    ``OWN_KEYS``: the entry's own, ``COMMON_KEYS`` among them), its I/O
    threads when ``num_threads`` is not given (``DEFAULT_THREADS``), and opens
    its store in ``_open_store``. Invariant: a constructor that raises leaves
    no thread running and no store open (``_open_store`` failing stops the I/O
    threads the base started and closes what it opened, through ``shutdown``).
    """

    TIER_KEYS: ClassVar[tuple[str, ...]]
    OWN_KEYS: ClassVar[tuple[str, ...]]
    DEFAULT_THREADS: ClassVar[int]

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **keys: Any,
    ) -> None:
        config, own = split_keys(tier_type, keys, self.TIER_KEYS, self.OWN_KEYS)
        if "num_threads" not in keys:
            config = config.replace(num_threads=self.DEFAULT_THREADS)
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector, config, own
        )
        try:
            self._open_store(f"secondary_tiers[{tier_type}]", config, own)
        except BaseException:
            KVOffloadTierBase.shutdown(self)
            raise

    def _open_store(self, where: str, config: TierConfig, own: Mapping[str, Any]) -> None:
        """Open the store (``where`` names the entry in error messages)."""
        raise NotImplementedError
