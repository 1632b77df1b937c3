"""The per-step offloading decisions, on the scheduler side (no tensors).

``OffloadingConnectorScheduler`` sits between an engine's scheduler, its GPU
``BlockPool`` and an ``OffloadingManager``:

- on a new request it says how many tokens past the GPU prefix hit can be
  loaded from the offload tier (``get_num_new_matched_tokens``);
- once the engine allocated GPU blocks it turns that into a load job (GPU
  block ids <- tier block ids) and pins the tier blocks;
- as blocks fill and their KV is computed it makes store jobs (eager mode);
- it settles jobs from the worker's results (``update_connector_output``).

Ownership rule that makes abort and preemption safe: every in-flight job
holds its own ref on the GPU blocks it reads or writes, taken with
``BlockPool.touch`` and dropped when the job settles. The engine can free a
request's blocks at any time; a block being copied cannot be reallocated
under the copy. When no job is in flight the connector holds no GPU ref and
no pinned tier block.

Lookups that a lower tier answers off the scheduler thread (Redis presence)
can say "not known yet": ``get_num_new_matched_tokens`` then returns None
(vLLM's "lookup in progress") and the engine retries the request next step,
at most ``max_lookup_defer_steps`` times; after that the request goes ahead
with what is known, so a slow or dead server never stalls admission.

Offloaded blocks may be ``block_size_factor`` GPU blocks each; the key of an
offloaded block is the hash of its last GPU block (which, chained, covers all
of them).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.connector.events import OffloadEventDescriber, tier_ownership
from kvoffload.engine.connector.metadata import ConnectorMetadata, TransferJob
from kvoffload.events import KVEvent
from kvoffload.hashing import BlockHash
from kvoffload.offload.base import (
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    make_offload_key,
)

STORE_MODES = ("eager", "lazy", "none")

# Steps a waiting request may be deferred while a lower tier is still asking whether
# it holds the request's next block (Redis presence, off the scheduler thread). A
# bound in steps, so a slow or dead server costs a request at most this many steps.
MAX_LOOKUP_DEFER_STEPS = 2


class JobOutcome(Protocol):
    """What the connector reads of a finished job (``transfer.TransferResult`` has both)."""

    @property
    def job_id(self) -> int: ...

    @property
    def success(self) -> bool: ...


@dataclass
class _Job:
    req_id: str
    keys: list[OffloadKey]
    gpu_blocks: list[KVCacheBlock]
    is_store: bool


@dataclass
class _PendingLoad:
    start_gpu_block: int
    keys: list[OffloadKey]


@dataclass
class ConnectorStats:
    loads_ok: int = 0
    loads_failed: int = 0
    stores_ok: int = 0
    stores_failed: int = 0
    stores_skipped_no_room: int = 0
    stores_declined: int = 0  # offloaded blocks the tier's admission declined (not stored)
    blocks_loaded: int = 0
    blocks_stored: int = 0


class OffloadingConnectorScheduler:
    def __init__(
        self,
        block_pool: BlockPool,
        manager: OffloadingManager,
        block_size: int,
        block_size_factor: int = 1,
        group_idx: int = 0,
        store_mode: str = "eager",
        max_lookup_defer_steps: int = MAX_LOOKUP_DEFER_STEPS,
    ) -> None:
        if max_lookup_defer_steps < 0:
            raise ValueError(f"max_lookup_defer_steps must be >= 0, got {max_lookup_defer_steps}")
        if block_size <= 0 or block_size_factor <= 0:
            raise ValueError(
                f"block_size and block_size_factor must be positive, got "
                f"{block_size} and {block_size_factor}"
            )
        if store_mode not in STORE_MODES:
            raise ValueError(f"unknown store_mode {store_mode!r}; known: {', '.join(STORE_MODES)}")
        self.pool = block_pool
        self.manager = manager
        self.block_size = block_size
        self.factor = block_size_factor
        self.group_idx = group_idx
        self.store_mode = store_mode
        self.stats = ConnectorStats()
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._load_job_of: dict[str, int] = {}
        self._next_store_block: dict[str, int] = {}  # eager: next offloaded-block index
        self._in_flight_keys: set[OffloadKey] = set()
        # Lazy stores: keys the tier declined, not offered again by the walk until a GPU
        # hit reads them (then freeing them again is a new sighting). Bounded, oldest out.
        self._declined: dict[OffloadKey, None] = {}
        self._meta = ConnectorMetadata()
        # Managers with lower tiers want to know whether a load's promotions
        # landed; the base contract's complete_load(keys) has no outcome.
        params = inspect.signature(manager.complete_load).parameters
        self._load_outcome = "success" in params
        # Only managers with lower tiers that answer off-thread can say "ask again".
        self._lookup_pending = getattr(manager, "lookup_pending", None)
        self._wait_lookups = getattr(manager, "wait_lookups", None)
        self.max_lookup_defer_steps = max_lookup_defer_steps
        self._deferred: dict[str, int] = {}  # request -> steps deferred so far
        # Tier events as each tier's exact set; self-describing once the engine says so
        # (the payloads come from the GPU tier's event stream).
        self.events = OffloadEventDescriber(block_size_factor, ownership=tier_ownership(manager))
        if block_pool.enable_kv_cache_events:
            block_pool.event_listeners.append(self.events.observe)

    # -- keys -----------------------------------------------------------------

    def _key(self, block_hashes: Sequence[BlockHash], offloaded_idx: int) -> OffloadKey:
        return make_offload_key(block_hashes[(offloaded_idx + 1) * self.factor - 1], self.group_idx)

    # -- loads ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
        num_prompt_tokens: int,
    ) -> int | None:
        """Tokens after ``num_computed_tokens`` (the GPU hit) that the tier can supply.

        ``num_prompt_tokens``: the request's tokens so far. Every full
        offloaded block of them is a candidate, the one that holds the last
        token included, as in vLLM 0.33's offloading connector (for
        full-attention KV). The last token itself must be computed (its
        logits give the next token), so when the hit reaches it the count
        returned stops one token short: the engine counts ``num_computed +
        returned`` tokens computed once the load lands and recomputes just
        that token, while ``update_state_after_alloc`` still loads the whole
        block. (vLLM's connector returns the full count and its scheduler
        takes the token back; the blocks loaded and the token recomputed are
        the same.) With ``block_size == 1`` that last block is the token
        alone and is not loaded.

        A GPU hit that ends inside an offloaded block gets no tier hit (a
        load must start at an offloaded block's boundary, and a gap cannot
        be skipped).

        None: a lower tier is still asking whether it holds the block after
        the hit; call again next step (at most ``max_lookup_defer_steps``
        times per request, then the answer is what is known).
        """
        self._pending_loads.pop(req_id, None)
        bs, f = self.block_size, self.factor
        if num_computed_tokens % bs:
            return 0
        start_gpu = num_computed_tokens // bs
        if start_gpu % f:
            return 0
        # The engine allocates blocks for num_prompt_tokens - 1 tokens: with
        # block_size 1 the last token's block is not among them.
        usable = num_prompt_tokens if bs > 1 else num_prompt_tokens - 1
        max_gpu_blocks = min(usable // bs, len(block_hashes))
        start, end = start_gpu // f, max_gpu_blocks // f
        if end <= start:
            return 0
        keys = [self._key(block_hashes, j) for j in range(start, end)]
        hit = self.manager.lookup(keys)
        if self._defer(req_id, keys, hit):
            return None
        if hit == 0:
            return 0
        self._pending_loads[req_id] = _PendingLoad(start_gpu, keys[:hit])
        hit_end = (start + hit) * f * bs
        return min(hit_end, num_prompt_tokens - 1) - num_computed_tokens

    def _defer(self, req_id: str, keys: Sequence[OffloadKey], hit: int) -> bool:
        if self._lookup_pending is not None and self._lookup_pending(keys, hit):
            n = self._deferred.get(req_id, 0)
            if n < self.max_lookup_defer_steps:
                self._deferred[req_id] = n + 1
                return True
        self._deferred.pop(req_id, None)
        return False

    def wait_for_lookups(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the answers deferred requests need.

        Only for an engine step that has nothing else to do: a busy engine
        just runs its other requests meanwhile. True when nothing is out.
        """
        if self._wait_lookups is None or not self._deferred:
            return True
        return bool(self._wait_lookups(timeout_s))

    def update_state_after_alloc(
        self, req_id: str, request_blocks: Sequence[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """The engine allocated ``request_blocks`` (head first); queue the load, if any."""
        pending = self._pending_loads.pop(req_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        # Ceil: a count one short of a block boundary (the last prompt token,
        # recomputed) still loads that whole block.
        per_block = self.block_size * self.factor
        n_offloaded = min(-(-num_external_tokens // per_block), len(pending.keys))
        keys = pending.keys[:n_offloaded]
        gpu_blocks = list(
            request_blocks[
                pending.start_gpu_block : pending.start_gpu_block + n_offloaded * self.factor
            ]
        )
        if len(gpu_blocks) != n_offloaded * self.factor:
            raise ValueError(
                f"request {req_id}: {num_external_tokens} external tokens need "
                f"{n_offloaded * self.factor} GPU blocks after block {pending.start_gpu_block}, "
                f"got {len(gpu_blocks)}"
            )
        src = self.manager.prepare_load(keys)  # pins until complete_load
        self.pool.touch(gpu_blocks)
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(req_id, keys, gpu_blocks, is_store=False)
        self._load_job_of[req_id] = job_id
        dst = GPULoadStoreSpec(np.fromiter((b.block_id for b in gpu_blocks), np.int64))
        self._meta.loads.append(TransferJob(job_id, req_id, src, dst, is_store=False))

    def is_loading(self, req_id: str) -> bool:
        return req_id in self._load_job_of

    # -- stores ---------------------------------------------------------------

    def on_blocks_computed(
        self,
        req_id: str,
        request_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """The request's KV is computed up to ``num_computed_tokens``: eager stores."""
        if self.store_mode != "eager":
            return
        f = self.factor
        full = min(num_computed_tokens // self.block_size, len(block_hashes)) // f
        start = self._next_store_block.get(req_id, 0)
        if full <= start:
            return
        self._next_store_block[req_id] = full
        self.store_blocks(
            req_id,
            [
                (self._key(block_hashes, j), request_blocks[j * f : (j + 1) * f])
                for j in range(start, full)
            ],
        )

    def store_blocks(
        self, req_id: str, candidates: Sequence[tuple[OffloadKey, Sequence[KVCacheBlock]]]
    ) -> int:
        """Queue one store job for those of ``candidates`` the tier lacks and admits.

        Returns how many offloaded blocks are being stored. Keys already stored
        are touched (recency); keys whose store is in flight are skipped. The
        tier is asked first which keys are worth a slot (``manager.admit``):
        only those are offered to ``prepare_store``, so a block its admission
        filter would evict first never displaces a stored one.
        """
        cands = [(k, b) for k, b in candidates if k not in self._in_flight_keys]
        # More than the tier can take at once: store the head of the chain, the
        # part every later hit needs first, rather than nothing.
        room = self.manager.num_room_blocks()
        if len(cands) > room:
            self.stats.stores_skipped_no_room += len(cands) - room
            cands = cands[:room]
        if not cands:
            return 0
        flags = self.manager.admit([k for k, _ in cands])
        if flags is not None:
            declined = [k for (k, _), f in zip(cands, flags) if not f]
            self.stats.stores_declined += len(declined)
            if self.store_mode == "lazy":
                self._remember_declined(declined)
            cands = [c for c, f in zip(cands, flags) if f]
            if not cands:
                return 0
        keys = [k for k, _ in cands]
        out = self.manager.prepare_store(keys)
        if out is None:
            self.stats.stores_skipped_no_room += len(keys)
            return 0
        to_store = set(out.keys_to_store)
        stored_already = [k for k in keys if k not in to_store]
        if stored_already:
            self.manager.touch(stored_already)
        if not out.keys_to_store:
            return 0
        by_key = dict(cands)
        gpu_blocks = [b for k in out.keys_to_store for b in by_key[k]]
        self.pool.touch(gpu_blocks)
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(req_id, list(out.keys_to_store), gpu_blocks, is_store=True)
        self._in_flight_keys.update(out.keys_to_store)
        src = GPULoadStoreSpec(np.fromiter((b.block_id for b in gpu_blocks), np.int64))
        self._meta.stores.append(TransferJob(job_id, req_id, src, out.store_spec, is_store=True))
        return len(out.keys_to_store)

    # -- GPU hits -------------------------------------------------------------

    def _remember_declined(self, keys: Sequence[OffloadKey]) -> None:
        declined = self._declined
        for k in keys:
            declined[k] = None
        limit = max(1024, self.pool.num_blocks)
        while len(declined) > limit:
            del declined[next(iter(declined))]

    def was_declined(self, key: OffloadKey) -> bool:
        """Whether the tier declined ``key`` and no GPU hit has read it since (lazy stores)."""
        return key in self._declined

    def touch_gpu_hit(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> None:
        """A GPU prefix hit also counts as a use of the same blocks in the tier."""
        n = num_blocks // self.factor
        if n:
            keys = [self._key(block_hashes, j) for j in range(n)]
            self.manager.touch(keys)
            if self._declined:
                for k in keys:
                    self._declined.pop(k, None)

    # -- per step -------------------------------------------------------------

    def build_connector_meta(self) -> ConnectorMetadata:
        meta, self._meta = self._meta, ConnectorMetadata()
        return meta

    def update_connector_output(self, results: Iterable[JobOutcome]) -> tuple[set[str], set[str]]:
        """Settle finished jobs; returns (requests whose load succeeded, whose load failed).

        ``results`` are ``TransferResult``-like: ``job_id`` and ``success``.
        Unknown job ids are an error: a result must never settle the wrong job.
        """
        loaded: set[str] = set()
        failed: set[str] = set()
        for res in results:
            job_id = res.job_id
            ok = bool(res.success)
            job = self._jobs.pop(job_id, None)
            if job is None:
                raise ValueError(f"transfer result for unknown job {job_id}")
            if job.is_store:
                self.manager.complete_store(job.keys, success=ok)
                self._in_flight_keys.difference_update(job.keys)
                if ok:
                    self.stats.stores_ok += 1
                    self.stats.blocks_stored += len(job.keys)
                else:
                    self.stats.stores_failed += 1
            else:
                if self._load_outcome:
                    self.manager.complete_load(job.keys, success=ok)  # type: ignore[call-arg]
                else:
                    self.manager.complete_load(job.keys)
                if self._load_job_of.get(job.req_id) == job_id:
                    del self._load_job_of[job.req_id]
                    (loaded if ok else failed).add(job.req_id)
                if ok:
                    self.stats.loads_ok += 1
                    self.stats.blocks_loaded += len(job.keys)
                else:
                    self.stats.loads_failed += 1
            # Tail first, so the freed copy keeps chain order in the free queue.
            self.pool.free_blocks(reversed(job.gpu_blocks))
        return loaded, failed

    def request_finished(self, req_id: str) -> None:
        """Forget the request. Its in-flight jobs finish on their own refs."""
        self._pending_loads.pop(req_id, None)
        self._next_store_block.pop(req_id, None)
        self._deferred.pop(req_id, None)
        # A load still in flight for a gone request settles without waking anyone.
        self._load_job_of.pop(req_id, None)

    def request_preempted(self, req_id: str) -> None:
        """Preempted requests restart from their prefix hit; same as finished here."""
        self.request_finished(req_id)

    # -- queue and session hints ----------------------------------------------

    def offload_keys(self, block_hashes: Sequence[BlockHash]) -> list[OffloadKey]:
        """The keys of every full offloaded block of ``block_hashes``, head first."""
        return [self._key(block_hashes, i) for i in range(len(block_hashes) // self.factor)]

    def request_queued(self, req_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request waits in the engine's queue: announce its full blocks to the tier."""
        self.manager.hint_queued(req_id, self.offload_keys(block_hashes))

    def request_dequeued(self, req_id: str) -> None:
        """The request left the queue (scheduled, aborted or finished)."""
        self.manager.hint_dequeued(req_id)

    def request_continues(self, block_hashes: Sequence[BlockHash]) -> None:
        """A finished request's conversation will continue (session hint)."""
        keys = self.offload_keys(block_hashes)
        if keys:
            self.manager.hint_continues(keys)

    # -- reset ----------------------------------------------------------------

    def reset_cache(self) -> bool:
        """Empty the offload tier(s); False (nothing changed) while any job is in flight.

        Like vLLM's connector reset, store progress starts over, so running
        requests offer their blocks again; the tier announces the removals
        (``take_events``). The GPU prefix cache is the engine's to reset.
        """
        if self._jobs or not self.manager.reset_cache():
            return False
        self._pending_loads.clear()
        self._next_store_block.clear()
        self._in_flight_keys.clear()
        self._deferred.clear()
        self._declined.clear()
        return True

    def num_in_flight_jobs(self) -> int:
        return len(self._jobs)

    def in_flight_job_ids(self, loads_only: bool = False) -> list[int]:
        if loads_only:
            return [j for j, job in self._jobs.items() if not job.is_store]
        return list(self._jobs)

    def take_events(self) -> list[KVEvent]:
        return self.events.translate(self.manager.take_events())
