"""``KVOffloadDiskTier``: kvoffload's bounded, checksummed disk tier as a vLLM secondary tier.

In vLLM's ``TieringOffloadingSpec``::

    "secondary_tiers": [{"type": "KVOffloadDiskTier",
                         "module_path": "kvoffload.integrations.vllm",
                         "disk_dir": "/nvme/kv", "disk_bytes": "1TiB"}]

Keys (checked once at start-up through ``TierConfig``; a bad or unknown key
is one ``TierConfigError`` line naming it):

- ``disk_dir`` (required): the directory; the tier keeps its slabs in a
  sub-directory named after the tier identity (``identity.tier_identity``), so
  engines whose KV differs (another model, revision, dtype, hash seed,
  parallel layout) share ``disk_dir`` without ever reading each other's
  blocks;
- ``disk_bytes`` (e.g. "1TiB") or ``disk_blocks``: the budget. The slabs are
  preallocated to it and the tier never grows past it: a store that needs
  room evicts the least recently used blocks (announced as removed). With
  data parallelism each replica (its own scheduler) owns an equal share of
  the budget in a store of its own under the identity's directory;
- ``num_threads`` (8): the tier's I/O threads (jobs in flight); ``direct_io`` (unset: where
  the filesystem allows it); ``durable`` (false): fsync before each index
  record;
- ``enable_events`` / ``enable_kv_events`` (true): emit ``STORAGE`` events
  (locality ``LOCAL``; ``locality: "REMOTE"`` for a shared mount) when vLLM
  publishes KV events;
- ``model_revision``: the model revision recorded in the identity when
  vLLM's config does not say it;
- ``write_mode`` may only be "write_through" (see ``base``).
- vLLM's own ``backpressure`` entry (e.g. ``{"backpressure_cls":
  "EMABackpressureDetector"}``) works as for its tiers: vLLM feeds the
  detector this tier's store results and drops cascades under pressure.

Lookups answer at once from the in-memory index (never ``RETRY``). Every
read is checked against the block's checksum: a corrupt or truncated block
is dropped and is a failed key of its promotion (vLLM recomputes it), as is
a block evicted between lookup and promotion. A full filesystem fails the
writes concerned (counted, one warning while it lasts), never a call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvoffload.integrations.vllm.tiers.base import KVOffloadStoreTier, logger
from kvoffload.integrations.vllm.tiers.identity import identity_digest
from kvoffload.integrations.vllm.tiers.io_threads import IOJob
from kvoffload.integrations.vllm.tiers.keys import COMMON_KEYS
from kvoffload.integrations.vllm.tiers.metrics import (
    AVAILABLE,
    BLOCKS_LOST,
    BYTES_IN_USE,
    CAPACITY_BYTES,
    CHECKSUM_FAILURES,
    EVICTIONS,
    STORES_DROPPED,
    WRITE_ERRORS,
)
from kvoffload.offload.base import BlockIDsLoadStoreSpec
from kvoffload.offload.base import OffloadKey as KVOKey
from kvoffload.tiers.config import TierConfig, TierConfigError
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.disk.slabs import ALIGN, round_up
from kvoffload.tiers.disk.store import DiskBlockStore
from kvoffload.tiers.identity import parse_fingerprint

if TYPE_CHECKING:
    pass

DISK_TIER_KEYS: tuple[str, ...] = (
    "disk_dir",
    "disk_bytes",
    "disk_blocks",
    "num_threads",
    "direct_io",
    "enable_events",
)
DISK_OWN_KEYS: tuple[str, ...] = (*COMMON_KEYS, "durable")
#: I/O threads when ``num_threads`` is not given: a disk needs requests in flight
#: (measured: 8 threads double the reads of 2 under vLLM's tiering, ``bench tiers-vllm``).
DEFAULT_THREADS = 8


def namespace_dir(
    disk_dir: str, model_name: str, identity: str, replica: int = 0, replicas: int = 1
) -> str:
    """Where one identity's blocks live under ``disk_dir``: ``kvoffload-<model>-<digest>``,
    and in it ``dp<replica>-of-<replicas>`` for each of several data-parallel replicas
    (each replica's scheduler owns its store; one process at a time opens a store)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)[-48:]
    path = os.path.join(disk_dir, f"kvoffload-{safe}-{identity_digest(identity)}")
    if replicas > 1:
        path = os.path.join(path, f"dp{replica}-of-{replicas}")
    return path


class KVOffloadDiskTier(KVOffloadStoreTier):
    """kvoffload's disk tier under vLLM's tiering manager (module docstring for the keys)."""

    DEFAULT_LOCALITY: ClassVar[Locality] = Locality.LOCAL

    TIER_KEYS: ClassVar[tuple[str, ...]] = DISK_TIER_KEYS
    OWN_KEYS: ClassVar[tuple[str, ...]] = DISK_OWN_KEYS
    DEFAULT_THREADS: ClassVar[int] = DEFAULT_THREADS

    def _open_store(self, where: str, config: TierConfig, own: Mapping[str, Any]) -> None:
        durable = own.get("durable", False)
        if not isinstance(durable, bool):
            raise TierConfigError(f"{where}['durable']: expected true or false, got {durable!r}")
        assert config.disk_dir is not None
        offloading_spec = self.offloading_spec
        self.slot_bytes = round_up(self.row_bytes, ALIGN)
        parallel = offloading_spec.config.parallel
        replicas = max(1, int(parallel.data_parallel_size))
        # Data-parallel replicas each run a scheduler, so each owns a share of the
        # budget (disk_bytes bounds the directory, not each replica) in its own store.
        self.capacity_blocks = config.disk_slots(self.slot_bytes) // replicas
        if self.capacity_blocks < 1:
            raise TierConfigError(
                f"{where}['disk_bytes']: the budget split over "
                f"{replicas} data-parallel replicas is smaller than one block "
                f"({self.slot_bytes} bytes) each"
            )
        self.directory = namespace_dir(
            config.disk_dir,
            offloading_spec.config.model.name,
            self.identity,
            int(parallel.data_parallel_index),
            replicas,
        )
        self.store = DiskBlockStore(
            self.directory,
            self.row_bytes,
            self.capacity_blocks,
            self.identity,
            hash_fn=parse_fingerprint(self.identity).get("hash_fn", ""),
            direct_io=config.direct_io,
            num_io_threads=4,
            durable=durable,
        )
        restored = [(KVOKey(e.key), e.slot) for e in self.store.entries()]
        self.manager = DiskOffloadingManager(
            self.capacity_blocks, enable_events=self._events_on, restored=restored
        )
        self._bad_seen = 0
        logger.info(
            "kvoffload disk tier %s: %s, %d blocks of %d bytes (%.2f GiB), %d restored, "
            "direct I/O %s",
            self.label,
            self.directory,
            self.capacity_blocks,
            self.row_bytes,
            self.capacity_blocks * self.slot_bytes / 2**30,
            len(restored),
            "on" if self.store.direct_io else "off",
        )

    # -- lookups and recency ---------------------------------------------------------

    def _lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.manager.is_stored(KVOKey(key)) else LookupResult.MISS

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch([KVOKey(k) for k in keys])

    # -- jobs ------------------------------------------------------------------------

    def _begin_store(
        self, job: TransferJob, keys: list[OffloadKey], chunks: list[int]
    ) -> IOJob | bool:
        chunk_of = dict(zip(keys, chunks))
        out = self.manager.prepare_store([KVOKey(k) for k in keys])
        if out is None:
            # Everything evictable is pinned by promotions in flight: skip this store.
            self.count(STORES_DROPPED, len(chunk_of))
            return False
        self.count(EVICTIONS, len(out.evicted_keys))
        if not out.keys_to_store:
            return True
        new = [OffloadKey(k) for k in out.keys_to_store]
        spec = out.store_spec
        assert isinstance(spec, BlockIDsLoadStoreSpec)  # the disk manager's slots
        return IOJob(
            job.job_id,
            False,
            new,
            [chunk_of[k] for k in new],
            slots=[int(s) for s in spec.block_ids],
        )

    def _begin_load(self, job: TransferJob, keys: list[OffloadKey], chunks: list[int]) -> IOJob:
        held = [(k, c) for k, c in zip(keys, chunks) if self.manager.is_stored(KVOKey(k))]
        self.count(BLOCKS_LOST, len(keys) - len(held))
        if not held:
            return IOJob(job.job_id, True, [], [])
        spec = self.manager.prepare_load([KVOKey(k) for k, _ in held])
        return IOJob(
            job.job_id,
            True,
            [k for k, _ in held],
            [c for _, c in held],
            slots=[int(s) for s in spec.block_ids],
        )

    def _run_io(self, job: IOJob) -> Sequence[bool]:
        assert job.slots is not None
        rows = self.rows(job.chunks)
        if job.is_load:
            return self.store.get_into(job.keys, rows, job.slots)
        return self.store.put(job.keys, rows, job.slots)

    def _end_job(self, job: IOJob) -> None:
        keys = [KVOKey(k) for k in job.keys]
        good = [k for k, ok in zip(keys, job.ok) if ok]
        bad = [k for k, ok in zip(keys, job.ok) if not ok]
        if job.is_load:
            if keys:
                self.manager.complete_load(keys)
            if bad:
                self.manager.drop(bad)
                self.count(BLOCKS_LOST, len(bad))
            stats = self.store.stats
            seen = stats.corrupt_blocks + stats.truncated_blocks
            self.count(CHECKSUM_FAILURES, seen - self._bad_seen)
            self._bad_seen = seen
            return
        if good:
            self.manager.complete_store(good, True)
        if bad:
            self.manager.complete_store(bad, False)
            self.count(WRITE_ERRORS, len(bad))

    def take_events(self) -> Iterable[OffloadingEvent]:
        for ev in self.manager.take_events():
            self.emit([OffloadKey(k) for k in ev.keys], ev.removed)
        return super().take_events()

    def _gauges(self) -> dict[str, float]:
        return {
            BYTES_IN_USE: float(self.manager.num_stored_blocks() * self.slot_bytes),
            CAPACITY_BYTES: float(self.capacity_blocks * self.slot_bytes),
            AVAILABLE: 1.0,
        }

    def reset_cache(self) -> None:
        """The disk tier forgets and deletes its blocks (forced: vLLM drops jobs in flight)."""
        self.manager.reset_cache(force=True)

    def _close_store(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
