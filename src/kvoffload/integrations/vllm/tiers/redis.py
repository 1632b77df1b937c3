"""``KVOffloadRedisTier``: kvoffload's Redis / Valkey tier as a vLLM secondary tier.

In vLLM's ``TieringOffloadingSpec``::

    "secondary_tiers": [{"type": "KVOffloadRedisTier",
                         "module_path": "kvoffload.integrations.vllm",
                         "redis_url": "redis://host:6379/0"}]

Keys (checked once at start-up through ``TierConfig``; a bad or unknown key
is one ``TierConfigError`` line naming it):

- ``redis_url`` (required): ``redis://``, ``rediss://``, ``valkey://``,
  ``unix://``, or a Redis Cluster seed list ``redis+cluster://h1:p1,h2:p2``;
- ``redis_namespace`` ("kvoffload"): prefixes every key; the key prefix also
  carries a digest of the tier identity (``identity.tier_identity``), so engines
  whose KV differs share a server without ever reading each other's blocks;
- ``redis_ttl_s`` (none): expire blocks, refreshed on every hit;
  ``redis_timeout_s`` (0.5): bounds every call (a slower server is an
  outage); ``retry_interval_s`` (1.0) / ``max_retry_interval_s`` (30): the
  breaker's first wait after an outage and its cap;
- ``num_threads`` (4): I/O threads; ``enable_events`` / ``enable_kv_events``
  (true): ``STORAGE`` events with locality ``REMOTE``;
- ``model_revision``: as for the disk tier; ``write_mode`` only
  "write_through".
- vLLM's own ``backpressure`` entry works as for its tiers; give
  ``"locality": "REMOTE"`` too, so that vLLM's EMA detector takes its
  network watermarks (vLLM picks them from that key or its own tier names).

Lookups never wait for the server: the keys the scheduler asks about in one
step are checked in one pipelined round trip (``STRLEN`` per key, per cluster
master) on a background thread after the step (``on_schedule_end``); until
the answer is in, ``lookup`` says ``RETRY`` (vLLM's asynchronous lookup
contract). A verdict is kept while a request that asked for it lives. The
server is the truth: a block it evicted (``maxmemory`` with
``allkeys-lru``) between the check and the promotion is a failed key of the
promotion, and vLLM recomputes it.

Outages: the store's breaker (per server or cluster master) turns a dead or
silent server into one warning, then misses and dropped stores without
touching the network; while the tier is down, ``lookup`` says ``MISS`` at
once and stores are dropped on the scheduler thread (counted), and a health
probe runs off the scheduler thread every step the breaker allows one;
"back" is one more warning.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.tiers.base import KVOffloadStoreTier, logger
from kvoffload.integrations.vllm.tiers.io_threads import IOJob
from kvoffload.integrations.vllm.tiers.keys import COMMON_KEYS
from kvoffload.integrations.vllm.tiers.metrics import (
    AVAILABLE,
    BLOCKS_LOST,
    CHECKSUM_FAILURES,
    STORES_DROPPED,
    WRITE_ERRORS,
)
from kvoffload.tiers.config import TierConfig, TierConfigError
from kvoffload.tiers.identity import parse_fingerprint
from kvoffload.tiers.redis.build import open_store

if TYPE_CHECKING:
    pass

REDIS_TIER_KEYS: tuple[str, ...] = (
    "redis_url",
    "redis_namespace",
    "redis_ttl_s",
    "redis_timeout_s",
    "num_threads",
    "enable_events",
)
REDIS_OWN_KEYS: tuple[str, ...] = (*COMMON_KEYS, "retry_interval_s", "max_retry_interval_s")

#: I/O threads when ``num_threads`` is not given (each runs one pipelined job at a time).
DEFAULT_THREADS = 4
#: Keys announced as stored that a removal event can later take back (least recent dropped).
MAX_ANNOUNCED = 1 << 16
#: A key no request asks about is probed again rather than trusted from memory.
_HEALTH_KEY = b"\0kvoffload-health"


@dataclass(slots=True)
class _Probe:
    """One key's presence check: asked by ``requests``, answered (``present``) or not yet."""

    generation: int
    in_flight: bool = False
    present: bool | None = None
    requests: set[str] = field(default_factory=set)


class PresenceChecks:
    """Non-blocking presence checks: one pipelined batch per scheduler step, off-thread.

    Scheduler side (under vLLM's manager lock): ``ask`` returns the verdict
    (True / False) or None (not known yet: RETRY); ``flush`` (once per step)
    sends every key asked since the last flush as one batch; ``release``
    drops a finished request's interest; ``forget`` marks keys absent
    (a failed promotion: no livelock on a doomed block); ``learn`` marks
    keys present (this instance just stored them). The background thread
    only calls ``exists`` (``RedisBlockStore.contains_many``) and queues the
    answers; generations keep a late answer off a key that was forgotten
    and asked again meanwhile.
    """

    def __init__(self, name: str, exists: Any) -> None:
        self._exists = exists
        self._probes: dict[OffloadKey, _Probe] = {}
        self._by_request: dict[str, set[OffloadKey]] = {}
        self._batch: list[tuple[OffloadKey, int]] = []
        self._next_gen = 0
        self._requests: queue.SimpleQueue[list[tuple[OffloadKey, int]] | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[list[tuple[OffloadKey, int, bool]]] = queue.SimpleQueue()
        self.batches = 0
        self.keys_checked = 0
        # Set here, cleared by the thread once the probe ran (a bool: atomic under the GIL).
        self._health_queued = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-lookup", daemon=True)
        self._thread.start()

    def ask(self, key: OffloadKey, req_id: str) -> bool | None:
        self.drain()
        probe = self._probes.get(key)
        if probe is None:
            probe = _Probe(self._next_gen)
            self._next_gen += 1
            self._probes[key] = probe
            self._batch.append((key, probe.generation))
        probe.requests.add(req_id)
        self._by_request.setdefault(req_id, set()).add(key)
        return probe.present

    def flush(self) -> None:
        self.drain()
        batch, self._batch = self._batch, []
        live = []
        for key, gen in batch:
            probe = self._probes.get(key)
            if probe is not None and probe.generation == gen and not probe.in_flight:
                probe.in_flight = True
                live.append((key, gen))
        if live:
            self._requests.put(live)

    def probe_health(self) -> None:
        """Queue a call that lets the store's breaker probe the server (answers ignored).

        At most one is queued at a time: a silent server holds each for a timeout.
        """
        if self._health_queued:
            return
        self._health_queued = True
        self._requests.put([(OffloadKey(_HEALTH_KEY), -1)])

    def drain(self) -> None:
        while True:
            try:
                answers = self._answers.get_nowait()
            except queue.Empty:
                return
            for key, gen, present in answers:
                probe = self._probes.get(key)
                if probe is None or probe.generation != gen:
                    continue
                probe.in_flight = False
                if not probe.requests:
                    del self._probes[key]
                    continue
                probe.present = present

    def release(self, req_id: str) -> None:
        for key in self._by_request.pop(req_id, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.requests.discard(req_id)
            if not probe.requests and not probe.in_flight:
                del self._probes[key]

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and not probe.in_flight:
                probe.present = False

    def learn(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and not probe.in_flight:
                probe.present = True

    @property
    def pending(self) -> bool:
        return bool(self._batch) or any(p.in_flight for p in self._probes.values())

    def _loop(self) -> None:
        while True:
            batch = self._requests.get()
            if batch is None:
                return
            keys = [k for k, _ in batch]
            try:
                found = list(self._exists(keys))
            except Exception as exc:  # an answer of "absent" beats a dead thread
                logger.warning("kvoffload Redis tier: presence check failed: %s", exc)
                found = [False] * len(keys)
            if batch[0][1] < 0:
                self._health_queued = False
                continue
            self.batches += 1
            self.keys_checked += len(keys)
            self._answers.put([(k, g, bool(f)) for (k, g), f in zip(batch, found)])

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join()
        self.drain()


class KVOffloadRedisTier(KVOffloadStoreTier):
    """kvoffload's Redis tier under vLLM's tiering manager (module docstring for the keys)."""

    DEFAULT_LOCALITY: ClassVar[Locality] = Locality.REMOTE
    #: Where vLLM counts the prompt tokens this tier served
    #: (``vllm:prompt_tokens_cached_by_source_total{source=...}``). vLLM derives "disk"
    #: from the STORAGE medium; its categories put a remote store under
    #: "external_unspecified" (``CacheHitSource``: "uninstrumented connector or remote
    #: store"), and a Redis server is a remote store even on localhost.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    TIER_KEYS: ClassVar[tuple[str, ...]] = REDIS_TIER_KEYS
    OWN_KEYS: ClassVar[tuple[str, ...]] = REDIS_OWN_KEYS
    DEFAULT_THREADS: ClassVar[int] = DEFAULT_THREADS

    def _open_store(self, where: str, config: TierConfig, own: Mapping[str, Any]) -> None:
        retry = _seconds(where, "retry_interval_s", own.get("retry_interval_s", 1.0))
        max_retry = _seconds(where, "max_retry_interval_s", own.get("max_retry_interval_s", 30.0))
        try:
            self.store = open_store(
                config,
                self.row_bytes,
                self.identity,
                parse_fingerprint(self.identity).get("hash_fn", ""),
                retry_interval_s=retry,
                max_retry_interval_s=max_retry,
            )
        except ValueError as exc:
            raise TierConfigError(f"{where}['redis_url']: {exc}") from None
        self._watch_store(self.store.ownership)
        logger.info(
            "kvoffload Redis tier %s: %s, namespace %s (prefix %s), %s",
            self.label,
            self.store.shown_url,
            config.redis_namespace,
            self.store.prefix.decode(errors="replace"),
            "reachable" if self.store.available else "unreachable: starting in an outage",
        )

    def _watch_store(self, ownership: str) -> None:
        """After ``store`` opened: its presence checks, announced keys and event ownership."""
        self.event_ownership = ownership  # instances sharing the store share this id
        self.checks = PresenceChecks(f"kvoffload-{self.tier_type}", self.store.contains_many)
        self._announced: OrderedDict[OffloadKey, None] = OrderedDict()
        self._bad_seen = 0

    # -- lookups -----------------------------------------------------------------------

    def _lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.store.available:
            return LookupResult.MISS
        present = self.checks.ask(key, req_context.req_id)
        if present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if present else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self.store.available:
            self.checks.flush()
        else:
            self.checks.drain()
            self.checks.probe_health()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.checks.release(req_context.req_id)

    def has_pending_work(self) -> bool:
        return super().has_pending_work() or (self.store.available and self.checks.pending)

    # -- jobs --------------------------------------------------------------------------

    def _begin_store(
        self, job: TransferJob, keys: list[OffloadKey], chunks: list[int]
    ) -> IOJob | bool:
        if not self.store.available:
            # The breaker says down: drop the store here, no bytes copied, no network.
            self.count(STORES_DROPPED, len(keys))
            return False
        return IOJob(job.job_id, False, keys, chunks)

    def _begin_load(self, job: TransferJob, keys: list[OffloadKey], chunks: list[int]) -> IOJob:
        return IOJob(job.job_id, True, keys, chunks)

    def _run_io(self, job: IOJob) -> Sequence[bool]:
        if job.is_load:
            return self.store.get_into(job.keys, self.rows(job.chunks))
        # A copy (the store copies each block into its value anyway): a failed put's
        # exception, kept by a log record, then holds no view of vLLM's shared region,
        # which vLLM could otherwise not unmap at shutdown.
        return self.store.put(job.keys, self.copy_rows(job.chunks))

    def _end_job(self, job: IOJob) -> None:
        good = [k for k, ok in zip(job.keys, job.ok) if ok]
        bad = [k for k, ok in zip(job.keys, job.ok) if not ok]
        if job.is_load:
            if bad:
                self.count(BLOCKS_LOST, len(bad))
                self.checks.forget(bad)
                self._unannounce(bad)
            stats = self.store.stats
            seen = stats.corrupt_values + stats.poisoned_keys
            self.count(CHECKSUM_FAILURES, seen - self._bad_seen)
            self._bad_seen = seen
            return
        if bad:
            self.count(WRITE_ERRORS if self.store.available else STORES_DROPPED, len(bad))
        if good:
            self.checks.learn(good)
            self._announce(good)

    def _announce(self, keys: Collection[OffloadKey]) -> None:
        new = [k for k in keys if k not in self._announced]
        for k in keys:
            self._announced[k] = None
            self._announced.move_to_end(k)
        while len(self._announced) > MAX_ANNOUNCED:
            self._announced.popitem(last=False)
        self.emit(new, removed=False)

    def _unannounce(self, keys: Collection[OffloadKey]) -> None:
        gone = [k for k in keys if self._announced.pop(k, 0) is None]
        self.emit(gone, removed=True)

    def _gauges(self) -> dict[str, float]:
        # Bytes in use are the server's (shared, evicting on its own): not known here.
        return {AVAILABLE: 1.0 if self.store.available else 0.0}

    def _close_store(self) -> None:
        checks = getattr(self, "checks", None)
        if checks is not None:
            checks.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


def _seconds(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TierConfigError(f"{where}[{key!r}]: expected seconds >= 0, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise TierConfigError(f"{where}[{key!r}]: expected seconds >= 0, got {value!r}") from None
    if seconds < 0:
        raise TierConfigError(f"{where}[{key!r}]: expected seconds >= 0, got {value!r}")
    return seconds
