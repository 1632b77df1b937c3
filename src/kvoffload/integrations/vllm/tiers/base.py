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

Identity: ``tier_identity`` is kvoffload's tier fingerprint for a vLLM
engine (model @ revision, KV dtype, cache layout, group geometry, bytes per
row, hash function and seed, and the parallel layout: world size and the
TP / PP / PCP / DCP sizes, or "agnostic" where vLLM certifies the row's bytes
as the same under any topology). The rank is not part of it: a row holds
every rank's shard.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
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

from kvoffload.tiers.config import TIER_KEYS, TierConfig, TierConfigError

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

# Under "vllm." so that vLLM's logging configuration shows these lines.
logger = logging.getLogger("vllm.kvoffload.tiers")

#: vLLM's label name for a tier (``tiering.base.TIER_LABEL``, spelled out: 0.32 lacks the name).
TIER_LABEL = "tier"

#: kvoffload's per-tier metrics, beyond vLLM's generic ``vllm:kv_offload_tiering_*``.
CHECKSUM_FAILURES = "kvoffload:tier_checksum_failures"
BLOCKS_LOST = "kvoffload:tier_blocks_lost"
EVICTIONS = "kvoffload:tier_evictions"
STORES_DROPPED = "kvoffload:tier_stores_dropped"
WRITE_ERRORS = "kvoffload:tier_write_errors"
BYTES_IN_USE = "kvoffload:tier_bytes_in_use"
CAPACITY_BYTES = "kvoffload:tier_capacity_bytes"
AVAILABLE = "kvoffload:tier_available"

#: Keys every kvoffload tier takes besides its ``TierConfig`` keys (see each tier's docstring).
COMMON_KEYS: tuple[str, ...] = ("locality", "enable_kv_events", "model_revision")


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Prometheus definitions of kvoffload's tier metrics (labelled by vLLM's tier label)."""
    labels = (TIER_LABEL,)

    def counter(doc: str) -> OffloadingCounterMetadata:
        return OffloadingCounterMetadata(documentation=doc, labelnames=labels)

    def gauge(doc: str) -> OffloadingGaugeMetadata:
        return OffloadingGaugeMetadata(documentation=doc, labelnames=labels)

    return {
        CHECKSUM_FAILURES: counter(
            "Blocks a kvoffload tier read back whose checksum (or length) was wrong: "
            "dropped and reported as failed promotion keys, never served."
        ),
        BLOCKS_LOST: counter(
            "Blocks a promotion asked a kvoffload tier for that it no longer held "
            "(evicted by the server, dropped as corrupt, tier unreachable)."
        ),
        EVICTIONS: counter("Blocks a kvoffload tier evicted to stay within its budget."),
        STORES_DROPPED: counter(
            "Blocks a kvoffload tier did not store: tier unreachable, no evictable room, "
            "or the store refused them."
        ),
        WRITE_ERRORS: counter("Blocks whose write to a kvoffload tier failed (I/O error)."),
        BYTES_IN_USE: gauge("Bytes of KV a kvoffload tier holds (stored blocks)."),
        CAPACITY_BYTES: gauge("A kvoffload tier's budget in bytes (0: the server's memory)."),
        AVAILABLE: gauge("1 while a kvoffload tier is reachable, 0 during an outage."),
    }


# -- keys and identity -------------------------------------------------------------------


def split_keys(
    tier_type: str,
    keys: Mapping[str, Any],
    tier_keys: Sequence[str],
    own_keys: Sequence[str],
) -> tuple[TierConfig, dict[str, Any]]:
    """``keys`` checked once: the ``TierConfig`` they describe and this tier's own keys.

    ``tier_keys``: the ``TierConfig`` keys this tier takes; ``own_keys``: its
    other keys. Any other key, a ``TierConfig`` key of the other tier, a bad
    value or write-back is a ``TierConfigError`` (one line naming the key).
    """
    where = f"secondary_tiers[{tier_type}]"
    allowed = [*tier_keys, "write_mode", "write_through", *own_keys]
    for key in keys:
        if key not in allowed:
            other = key in TIER_KEYS
            why = (
                "belongs to the other kvoffload tier (give each tier its own entry)"
                if other
                else f"unknown key; {tier_type} takes {', '.join(sorted(allowed))}"
            )
            raise TierConfigError(f"{where}[{key!r}]: {why}")
    tier = {k: v for k, v in keys.items() if k in tier_keys or k in ("write_mode", "write_through")}
    if "enable_kv_events" in keys:
        if "enable_events" in keys:
            raise TierConfigError(
                f"{where}['enable_kv_events']: give it or enable_events, not both"
            )
        tier["enable_events"] = keys["enable_kv_events"]
    config = TierConfig.from_mapping(tier, where=where)
    if config is None:
        need = "disk_dir" if "disk_dir" in tier_keys else "redis_url"
        raise TierConfigError(f"{where}[{need!r}]: missing")
    if config.write_mode != "write_through" and ("write_mode" in keys or "write_through" in keys):
        key = "write_mode" if "write_mode" in keys else "write_through"
        raise TierConfigError(
            f"{where}[{key!r}]: vLLM's tiering writes every block to every tier as it "
            "reaches the CPU tier (write-through); write-back needs the CPU tier's "
            "evictions, which vLLM does not give secondary tiers"
        )
    own = {k: v for k, v in keys.items() if k in own_keys}
    if "locality" in own:
        value = own["locality"]
        try:
            own["locality"] = Locality(str(value).upper())
        except ValueError:
            raise TierConfigError(
                f"{where}['locality']: expected LOCAL or REMOTE, got {value!r}"
            ) from None
    if "model_revision" in own:
        rev = own["model_revision"]
        if not isinstance(rev, str) or not rev.strip():
            raise TierConfigError(f"{where}['model_revision']: expected a non-empty string")
    return config, own


def _quote(value: object) -> str:
    return urllib.parse.quote(str(value), safe="/:@.-_+,")


def _engine_facts() -> tuple[str | None, str]:
    """(model revision, prefix-caching hash algorithm) from vLLM's current config, if any."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - both supported releases have it
        cfg = None
    if cfg is None:
        return None, "sha256"
    revision = getattr(cfg.model_config, "revision", None) if cfg.model_config else None
    algo = str(getattr(cfg.cache_config, "prefix_caching_hash_algo", "sha256") or "sha256")
    return (str(revision) if revision else None), algo


def is_parallel_agnostic(spec: OffloadingSpec) -> bool:
    """Whether vLLM certifies a row's bytes as the same under any parallel layout.

    As vLLM's fs tier decides: the parallel config says the concatenated
    shards are topology-free (``is_parallelism_agnostic``), or the layout is
    replicated (one copy of an MLA latent for all ranks).
    """
    config = spec.config
    return bool(config.parallel.is_parallelism_agnostic or config.replicated_layout)


def tier_identity(spec: OffloadingSpec, row_bytes: int, model_revision: str | None = None) -> str:
    """kvoffload's tier fingerprint for a vLLM engine, as one ``k=v;...`` string.

    Fields: ``format``; ``model`` (name @ revision: ``model_revision``, else
    vLLM's current model config's revision, else "unknown"); ``dtype`` (KV
    cache dtype); ``kv_layout`` (vLLM's KV cache layout) and ``canonical``
    (the canonical byte format, or "direct"); ``groups`` (per KV cache group:
    tokens per block, layer count and a digest of the layer names);
    ``tokens_per_hash``, ``blocks_per_chunk`` and ``row_bytes`` (bytes per
    offloaded chunk, every rank's shard and padding); ``hash_fn`` and
    ``hash_seed`` (vLLM's prefix-caching hash and its ``NONE_HASH`` seed:
    "random" when vLLM draws it per process); ``parallel`` ("agnostic" when
    vLLM certifies it, else world size and TP / PP / PCP / DCP sizes, and
    "replicated" for a single-copy layout). It parses with
    ``kvoffload.tiers.identity.parse_fingerprint``.
    """
    from kvoffload.hashing.block_hash import none_hash_seed_is_random, resolve_none_hash_seed

    config = spec.config
    revision, algo = _engine_facts()
    revision = model_revision or revision or "unknown"
    seed = "random" if none_hash_seed_is_random(algo) else resolve_none_hash_seed(algo)
    if len(seed) > 32:
        # A long seed (an operator's PYTHONHASHSEED) is recorded as a digest.
        seed = "sha256:" + hashlib.sha256(seed.encode()).hexdigest()[:16]
    groups = ",".join(
        f"{g.tokens_per_block}x{len(g.layer_names)}:"
        + hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:8]
        for g in config.groups
    )
    canonical = "direct"
    if getattr(config, "canonical_layout", False):
        canonical = f"canonical:{getattr(config, 'kv_cache_layout', None)}"
    p = config.parallel
    if is_parallel_agnostic(spec):
        parallel = "agnostic"
    else:
        parallel = (
            f"world{p.world_size}-tp{p.tp_size}-pp{p.pp_size}-pcp{p.pcp_size}-dcp{p.dcp_size}"
        )
    if config.replicated_layout:
        parallel += "-replicated"
    values = {
        "format": "vllm-row-v1",
        "model": f"{config.model.name}@{revision}",
        "dtype": config.model.dtype,
        "kv_layout": getattr(config, "kv_cache_layout", None) or "default",
        "canonical": canonical,
        "groups": groups,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "row_bytes": row_bytes,
        "hash_fn": algo,
        "hash_seed": seed,
        "parallel": parallel,
    }
    return ";".join(f"{k}={_quote(v)}" for k, v in values.items())


def identity_digest(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def tier_label_of(spec: OffloadingSpec, tier_type: str) -> str:
    """vLLM's label for this tier ("<index + 1>:<type>", as its tiering metrics spell it).

    A tier is not told its index: it is the n-th ``secondary_tiers`` entry of
    its type, n counting the tiers of that type built for this spec so far
    (vLLM builds them in order).
    """
    configs = getattr(spec, "secondary_tier_configs", None) or []
    claims: list[str] = spec.__dict__.setdefault("_kvoffload_tier_claims", [])
    before = claims.count(tier_type)
    claims.append(tier_type)
    matches = [
        i
        for i, cfg in enumerate(configs)
        if isinstance(cfg, Mapping) and cfg.get("type") == tier_type
    ]
    if before < len(matches):
        return f"{matches[before] + 1}:{tier_type}"
    return f"?:{tier_type}"


# -- the I/O side --------------------------------------------------------------------------


@dataclass
class IOJob:
    """One job's bytes to move; built on the scheduler thread, run on an I/O thread.

    ``keys[i]`` goes to / comes from primary chunk ``chunks[i]``; ``slots`` is
    the tier's own placement (disk slots), when it has one. ``ok`` is filled
    in by the I/O thread, one flag per key.
    """

    job_id: JobId
    is_load: bool
    keys: list[OffloadKey]
    chunks: list[int]
    slots: list[int] | None = None
    #: Every key of the vLLM job (a load may have dropped some before the I/O).
    job_keys: list[OffloadKey] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""


class _IOThreads:
    """A few threads running ``IOJob``s, loads first; finished jobs in a queue."""

    def __init__(self, name: str, num_threads: int, run: Any) -> None:
        self._run = run
        self._loads: deque[IOJob] = deque()
        self._stores: deque[IOJob] = deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._stop = False
        self.finished: deque[IOJob] = deque()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-io{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: IOJob) -> None:
        with self._cond:
            if self._stop:
                job.ok = [False] * len(job.keys)
                job.error = "tier shut down"
                self.finished.append(job)
                return
            self._inflight += 1
            (self._loads if job.is_load else self._stores).append(job)
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._loads or self._stores)
                if self._loads:
                    job = self._loads.popleft()
                elif self._stores:
                    job = self._stores.popleft()
                else:
                    return
            start = time.perf_counter()
            try:
                job.ok = [bool(x) for x in self._run(job)]
            except Exception as exc:  # the job fails; the tier keeps serving
                job.ok = [False] * len(job.keys)
                job.error = f"{type(exc).__name__}: {exc}"
            job.seconds = time.perf_counter() - start
            with self._cond:
                self.finished.append(job)
                self._inflight -= 1
                self._cond.notify_all()

    def wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def stop(self) -> None:
        """Finish the jobs queued so far, then end the threads."""
        self.wait_idle()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


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
        self.tier_config = tier_config
        self.locality = own_keys.get("locality", self.DEFAULT_LOCALITY)
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
        self._io = _IOThreads(
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
                    keys=keys, medium=self.medium, removed=removed, locality=self.locality
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

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        return {}

    # -- introspection (tests, benchmarks) ---------------------------------------------

    def counters(self) -> dict[str, int]:
        """Counts since the last ``get_stats`` (which resets them)."""
        return dict(self._counters)

    def gauges(self) -> dict[str, float]:
        return self._gauges()
