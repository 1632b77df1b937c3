"""A stack of tiers behind one ``OffloadingManager``: CPU memory, then disk, then remote.

The GPU side only ever exchanges bytes with CPU slots; the tiers below are
reached through them:

- lookup: a key counts when some tier has it (CPU first, then each lower
  tier in order); a run of hits stops at the first key no tier has, at a key
  whose CPU store is in flight, or when the CPU tier could not make room for
  the lower-tier hits (they must be promoted to be loaded).
- load: CPU hits are pinned; lower-tier hits are pinned where they are and
  get fresh CPU slots (a CPU store in flight). The spec handed to the worker
  is a ``TieredLoadStoreSpec``: promotions (lower -> CPU, required) first,
  then the normal CPU -> GPU copy. A load with CPU hits only stays a plain
  ``CPULoadStoreSpec``. A key that has left every tier since its lookup (a
  Redis evicting under ``maxmemory``, a TTL, another engine's reset) makes
  the load a failed job, never an error: the engine recomputes, as it does
  when a lower-tier block turns out unreadable during the copy.
- store: the CPU tier takes the blocks. In ``write_back`` mode the blocks it
  evicts to make room are written down to the first lower tier (whose own
  victims cascade to the next one); in ``write_through`` mode every stored
  block is also written to every lower tier after the GPU -> CPU copy.
  Write-downs are best effort: the job's success is the GPU <-> CPU part.
- events: each tier reports its own, with its own medium ("CPU", "DISK",
  "REMOTE").

Slot ownership makes concurrent jobs safe without ordering between them: a
victim's slot is read only by the job that evicted it, before that job's
copies overwrite it (the copies of one job run in order); lower-tier copies
being written are not loadable until their job completes.

Outcomes: a promoted block becomes loadable from the CPU tier only when
``complete_load(keys, success=True)`` says the job succeeded; without a
``success`` (an engine that does not pass it) the promoted copies are
discarded, which is safe but wastes the promotion. On ``success=False`` the
lower-tier copies it read from are dropped too: one of them was unusable and
must not be offered again. Write-downs are marked stored when their job
completes, whatever happened: the stores verify every block they return
(checksums), so a write-down that failed is at worst a miss later, which
then drops it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from kvoffload.offload.base import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)
from kvoffload.offload.cpu_manager import CPUOffloadingManager
from kvoffload.tiers.lower_tier import LowerTierManager, TierCopy, TieredLoadStoreSpec
from kvoffload.tiers.tiered_records import PendingLoad, PendingStore, TieredStats, TierKeys
from kvoffload.tiers.write_down import subset_spec, write_down

WRITE_MODES = ("write_back", "write_through")
_CPU = -1
_NONE = -2


class TieredOffloadingManager(OffloadingManager):
    """``cpu`` on top of ``lower`` (e.g. ``[disk, remote]``), looked up in that order.

    ``medium``, ``num_blocks`` and the room figures are the CPU tier's: it is
    the tier GPU blocks are stored into. ``is_stored`` checks CPU memory and
    the lower tiers that answer locally (not the remote one, which would cost
    a round trip per block on the lazy store path).
    """

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        lower: Sequence[LowerTierManager] = (),
        write_mode: str = "write_back",
    ) -> None:
        if write_mode not in WRITE_MODES:
            raise ValueError(f"unknown write_mode {write_mode!r}; known: {', '.join(WRITE_MODES)}")
        media = [cpu.medium, *(t.medium for t in lower)]
        if len(set(media)) != len(media):
            raise ValueError(f"tiers must have distinct media, got {media}")
        self.cpu = cpu
        self.lower: list[LowerTierManager] = list(lower)
        self.write_mode = write_mode
        self.stats = TieredStats()
        self._local = [t for t in self.lower if t.answers_locally]
        self._loads: dict[tuple[OffloadKey, ...], deque[PendingLoad]] = {}
        # A key is in at most one CPU store at a time, so key -> its store's record.
        self._store_of: dict[OffloadKey, PendingStore] = {}
        self._num_stores = 0
        # CPU keys being written by a promotion: only their load settles them.
        self._promoting: set[OffloadKey] = set()

    # -- introspection ------------------------------------------------------

    @property
    def medium(self) -> str:
        return self.cpu.medium

    @property
    def num_blocks(self) -> int:
        return self.cpu.num_blocks

    def num_free_blocks(self) -> int:
        return self.cpu.num_free_blocks()

    def num_evictable_blocks(self) -> int:
        return self.cpu.num_evictable_blocks()

    def is_stored(self, key: OffloadKey) -> bool:
        return self.cpu.is_stored(key) or any(t.is_stored(key) for t in self._local)

    def tier_of(self, keys: Sequence[OffloadKey]) -> list[str | None]:
        """For each key, the medium a load would take it from now (None: no tier has it)."""
        names = [t.medium for t in self.lower]
        return [
            self.cpu.medium if t == _CPU else None if t == _NONE else names[t]
            for t in self._classify(keys)
        ]

    def _classify(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Per key: ``_CPU``, the index of the first lower tier that has it, or ``_NONE``.

        A key whose CPU store is in flight is ``_NONE``: it cannot be loaded
        yet, nor promoted into a slot it already has.
        """
        cpu = self.cpu
        where = [_NONE] * len(keys)
        todo: list[int] = []
        for i, k in enumerate(keys):
            if cpu.is_stored(k):
                where[i] = _CPU
            elif not cpu.is_storing(k):
                todo.append(i)
        for t, tier in enumerate(self.lower):
            if not todo:
                break
            mask = tier.stored_mask([keys[i] for i in todo])
            rest = []
            for i, there in zip(todo, mask):
                if there:
                    where[i] = t
                else:
                    rest.append(i)
            todo = rest
        return where

    def _promotion_room(self, cpu_keys: Sequence[OffloadKey]) -> int:
        """CPU slots a promotion can get once ``cpu_keys`` are pinned by the same load."""
        cpu = self.cpu
        newly_pinned = sum(1 for k in set(cpu_keys) if cpu.ref_count(k) == 0)
        return cpu.num_room_blocks() - newly_pinned

    # -- loads --------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        n_cpu = self.cpu.lookup(keys)
        if n_cpu == len(keys) or not self.lower:
            return n_cpu
        where = self._classify(keys)
        cpu_keys: list[OffloadKey] = []
        promo = 0
        n = 0
        for k, t in zip(keys, where):
            if t == _NONE:
                break
            if t == _CPU:
                cpu_keys.append(k)
            else:
                promo += 1
                if promo > self._promotion_room(cpu_keys):
                    break
            n += 1
        return n

    def lookup_pending(self, keys: Sequence[OffloadKey], hit: int) -> bool:
        """After ``lookup(keys)`` returned ``hit``: whether the run may grow once a lower
        tier that answers off the scheduler thread has answered for ``keys[hit]``.

        A caller that can defer a request (vLLM's "lookup in progress") asks
        again next step instead of recomputing what another engine stored.
        """
        if hit >= len(keys):
            return False
        k = keys[hit]
        if self.cpu.is_stored(k) or self.cpu.is_storing(k):
            return False
        return any(t.awaiting(k) for t in self.lower)

    def wait_lookups(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` in all for the lower tiers' pending presence answers.

        Only for a caller with nothing else to do (an idle engine step); False if
        some answers are still out (a slow or dead server: go on without them).
        """
        deadline = time.monotonic() + timeout_s
        return all(t.wait_answers(max(0.0, deadline - time.monotonic())) for t in self.lower)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("keys of one load must be distinct")
        if not self.lower or self.cpu.lookup(keys) == len(keys):
            spec = self.cpu.prepare_load(keys)
            self.stats.load_blocks[self.cpu.medium] += len(keys)
            return spec
        where = self._classify(keys)
        cpu_keys = [k for k, t in zip(keys, where) if t == _CPU]
        promo = [k for k, t in zip(keys, where) if t != _CPU]
        record = PendingLoad(cpu_keys, [], [], [])
        vanished = sum(1 for t in where if t == _NONE)
        if vanished:
            # Evicted since lookup (a Redis under maxmemory, a TTL, another engine's
            # reset): the load fails and the engine recomputes, as for a bad block.
            self.stats.vanished_loads += 1
            return self._failed_load(
                keys, record, f"{vanished} of {len(keys)} blocks left every tier since lookup"
            )
        if len(promo) > self._promotion_room(cpu_keys):
            return self._no_room(keys, record)
        slot_of: dict[OffloadKey, int] = {}
        if cpu_keys:
            pinned = self.cpu.prepare_load(cpu_keys)
            slot_of.update(zip(cpu_keys, pinned.block_ids.tolist()))
        sources: list[tuple[LowerTierManager, list[OffloadKey], LoadStoreSpec]] = []
        for t, tier in enumerate(self.lower):
            tkeys = [k for k, w in zip(keys, where) if w == t]
            if tkeys:
                sources.append((tier, tkeys, tier.prepare_load(tkeys)))
                record.lower_pins.append((tier, tkeys))
        out = self.cpu.prepare_store(promo)
        if out is None or out.keys_to_store != promo:
            # Not expected after the room check; undo and fail the job cleanly.
            if out is not None:
                self.cpu.complete_store(out.keys_to_store, success=False)
            self._unpin(record)
            record.lower_pins = []
            return self._no_room(keys, record)
        record.promoted = promo
        self._promoting.update(promo)
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        slot_of.update(zip(promo, out.store_spec.block_ids.tolist()))
        before: list[TierCopy] = []
        if out.evicted_keys and self.write_mode == "write_back":
            assert out.evicted_spec is not None
            copies, record.written = self._write_down(out.evicted_keys, out.evicted_spec)
            before.extend(copies)
        for tier, tkeys, src in sources:
            dst = CPULoadStoreSpec([slot_of[k] for k in tkeys])
            before.append(TierCopy(src, dst, required=True))
            self.stats.load_blocks[tier.medium] += len(tkeys)
        self.stats.load_blocks[self.cpu.medium] += len(cpu_keys)
        self.stats.promotions += len(promo)
        self._loads.setdefault(tuple(keys), deque()).append(record)
        return TieredLoadStoreSpec(CPULoadStoreSpec([slot_of[k] for k in keys]), before)

    def _no_room(self, keys: list[OffloadKey], record: PendingLoad) -> TieredLoadStoreSpec:
        self.stats.no_room_loads += 1
        return self._failed_load(keys, record, "no CPU room to promote lower-tier blocks")

    def _failed_load(
        self, keys: list[OffloadKey], record: PendingLoad, why: str
    ) -> TieredLoadStoreSpec:
        """A load that must fail: nothing stays pinned, ``complete_load`` just settles it."""
        record.error = True
        record.cpu_keys = []
        self._loads.setdefault(tuple(keys), deque()).append(record)
        return TieredLoadStoreSpec(CPULoadStoreSpec([]), error=why)

    def _unpin(self, record: PendingLoad) -> None:
        if record.cpu_keys:
            self.cpu.complete_load(record.cpu_keys)
        for tier, tkeys in record.lower_pins:
            tier.complete_load(tkeys)

    def complete_load(self, keys: Sequence[OffloadKey], success: bool | None = None) -> None:
        """Drop the load's pins; promoted blocks stay in CPU only when ``success`` is True."""
        key_tuple = tuple(keys)
        queue = self._loads.get(key_tuple)
        if not queue:
            self.cpu.complete_load(keys)
            if success is not False:
                self.stats.loaded_blocks[self.cpu.medium] += len(key_tuple)
            return
        record = queue.popleft()
        if not queue:
            del self._loads[key_tuple]
        if record.error:
            return
        self._unpin(record)
        if success is not False:
            self.stats.loaded_blocks[self.cpu.medium] += len(record.cpu_keys)
            for tier, tkeys in record.lower_pins:
                self.stats.loaded_blocks[tier.medium] += len(tkeys)
        if record.promoted:
            self._promoting.difference_update(record.promoted)
            keep = success is True
            self.cpu.complete_store(record.promoted, success=keep)
            if success is None:
                self.stats.promotions_discarded += len(record.promoted)
            elif not keep:
                self.stats.promotions_failed += len(record.promoted)
                for tier, tkeys in record.lower_pins:
                    tier.drop(tkeys)
        for tier, wkeys in record.written:
            tier.complete_store(wkeys, success=True)

    def hit_blocks_by_medium(self) -> dict[str, int]:
        """Blocks loaded from each tier so far (loads that reported failure excluded)."""
        return dict(self.stats.loaded_blocks)

    @property
    def lower_hit_blocks(self) -> int:
        """Blocks loaded from the tiers below CPU memory so far."""
        cpu = self.cpu.medium
        return sum(n for m, n in self.stats.loaded_blocks.items() if m != cpu)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.cpu.touch(keys)
        for tier in self.lower:
            tier.touch(keys)

    # -- stores -------------------------------------------------------------

    def _write_down(
        self, keys: list[OffloadKey], src: LoadStoreSpec
    ) -> tuple[list[TierCopy], TierKeys]:
        """``write_down`` into the first lower tier, counted in ``stats.write_downs``."""
        copies, started = write_down(self.lower, keys, src, 0)
        self.stats.write_downs += sum(len(k) for _, k in started)
        return copies, started

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = self.cpu.prepare_store(keys)
        if out is None or not out.keys_to_store or not self.lower:
            return out
        before: list[TierCopy] = []
        record = PendingStore([], [])
        if out.evicted_keys and self.write_mode == "write_back":
            assert out.evicted_spec is not None
            before, record.before = self._write_down(out.evicted_keys, out.evicted_spec)
        after: list[TierCopy] = []
        if self.write_mode == "write_through":
            stored = list(out.keys_to_store)
            for tier in self.lower:
                o = tier.prepare_store(stored)
                if o is None or not o.keys_to_store:
                    continue
                src = subset_spec(out.store_spec, stored, o.keys_to_store)
                after.append(TierCopy(src, o.store_spec, required=False))
                record.after.append((tier, list(o.keys_to_store)))
                self.stats.write_throughs += len(o.keys_to_store)
        if not before and not after:
            return out
        record.waiting = set(out.keys_to_store)
        for key in record.waiting:
            self._store_of[key] = record
        self._num_stores += 1
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        return PrepareStoreOutput(
            out.keys_to_store,
            TieredLoadStoreSpec(out.store_spec, before, after),
            out.evicted_keys,
            out.evicted_spec,
        )

    def admit(self, keys: Sequence[OffloadKey]) -> list[bool] | None:
        """The CPU tier's admission: stores land there first."""
        return self.cpu.admit(keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Complete the CPU store of ``keys`` (any superset, e.g. ``prepare_store``'s keys).

        A store's lower-tier copies settle once all its CPU keys completed.
        Keys a promotion is writing are left to that load's ``complete_load``.
        Any other key of ``keys`` being stored completes, even when another
        store job is writing it: pass ``keys_to_store`` when that can happen.
        """
        promoting = self._promoting
        storing = [k for k in dict.fromkeys(keys) if self.cpu.is_storing(k) and k not in promoting]
        self.cpu.complete_store(storing, success)
        for key in storing:
            record = self._store_of.pop(key, None)
            if record is None:
                continue
            record.waiting.discard(key)
            record.ok = record.ok and success
            if not record.waiting:
                self._settle_store(record)

    def _settle_store(self, record: PendingStore) -> None:
        self._num_stores -= 1
        for tier, k in record.before:
            tier.complete_store(k, success=True)
        for tier, k in record.after:
            # Write-throughs run only after a successful GPU -> CPU copy.
            tier.complete_store(k, success=record.ok)

    # -- hints (the CPU tier's policy uses them; a remote tier prefetches presence) --

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        self.cpu.hint_queued(request_id, keys)
        for tier in self.lower:  # a remote tier learns what the server has before the lookup
            tier.hint_queued(request_id, keys)

    def hint_dequeued(self, request_id: str) -> None:
        self.cpu.hint_dequeued(request_id)

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        self.cpu.hint_continues(keys)

    # -- reset --------------------------------------------------------------

    def can_reset_cache(self) -> bool:
        return (
            self.num_in_flight() == 0
            and self.cpu.can_reset_cache()
            and all(t.can_reset_cache() for t in self.lower)
        )

    def reset_cache(self, force: bool = False) -> bool:
        """Reset every tier, or none: False while any of them has a load or store in flight.

        Each tier announces its own removals (the remote tier forgets only
        what this instance knows; see ``RemoteOffloadingManager``).
        """
        if not force and not self.can_reset_cache():
            return False
        self._loads.clear()
        self._promoting.clear()
        self._store_of.clear()
        self._num_stores = 0
        self.cpu.reset_cache(force=True)
        for tier in self.lower:
            tier.reset_cache(force=True)
        return True

    # -- events -------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events = list(self.cpu.take_events())
        for tier in self.lower:
            events.extend(tier.take_events())
        return events

    def num_in_flight(self) -> int:
        """Tiered loads and stores waiting for their ``complete_*`` call."""
        return sum(len(q) for q in self._loads.values()) + self._num_stores
