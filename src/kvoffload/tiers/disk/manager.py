"""The disk tier's manager: ``num_blocks`` slots of the disk store, by slot id, in LRU order.

State per key (life cycle as in ``kvoffload.offload.base``):

- ``_slot_of``: every key held, stored or being stored, and its slot;
- ``_storing``: keys whose store is in flight (not loadable, not evictable);
- ``_refs``: load pins of stored keys (present only while > 0);
- ``_lru``: the stored, unpinned keys, least recently used first: exactly
  the eviction candidates;
- ``_doomed``: stored keys dropped while pinned; they go when unpinned.

Invariants: the slots of ``_slot_of`` and ``_free`` are disjoint and together
are ``range(num_blocks)``; ``_lru`` and ``_refs`` partition the stored keys.
Every operation is O(len(keys)).

The disk tier is large and far from the GPU, so plain LRU (one call's keys
applied tail first, so a chain is evicted from its tail) is its policy; the
choice of slots and victims is made here, never by the store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvoffload.offload.base import (
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    finish_stores,
    reassign_slots,
    release_pins,
)
from kvoffload.tiers.lower_tier import DISK_MEDIUM, DiskLoadStoreSpec, LowerTierManager


class DiskOffloadingManager(LowerTierManager):
    """Slots, pins and events of the disk tier.

    ``restored``: the blocks a re-opened disk store still holds, as
    ``(key, slot)`` oldest write first (``DiskBlockStore.entries()``); they
    start stored, least recently used first, and are announced as one
    stored event.

    ``clear_store``: called by ``reset_cache`` so that the disk store forgets
    its blocks too (``DiskBlockStore.clear``); without it a restart would
    restore, and serve, blocks from before the reset.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_events: bool = False,
        restored: Iterable[tuple[OffloadKey, int]] = (),
        clear_store: Callable[[], object] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self.enable_events = enable_events
        self.clear_store = clear_store
        self._slot_of: dict[OffloadKey, int] = {}
        self._storing: set[OffloadKey] = set()
        self._refs: dict[OffloadKey, int] = {}
        self._lru: OrderedDict[OffloadKey, None] = OrderedDict()
        self._doomed: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] = []
        used: set[int] = set()
        for key, slot in restored:
            if not 0 <= slot < num_blocks:
                raise ValueError(f"restored slot {slot} out of range [0, {num_blocks})")
            if slot in used or key in self._slot_of:
                raise ValueError(f"restored entries repeat slot {slot} or key {key.hex()}")
            used.add(slot)
            self._slot_of[key] = slot
            self._lru[key] = None
        self._free: list[int] = [s for s in range(num_blocks - 1, -1, -1) if s not in used]
        if self._lru and enable_events:
            self._events.append(OffloadingEvent(list(self._lru), DISK_MEDIUM, removed=False))

    # -- introspection ------------------------------------------------------

    @property
    def medium(self) -> str:
        return DISK_MEDIUM

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    def num_stored_blocks(self) -> int:
        return len(self._slot_of) - len(self._storing) - len(self._doomed)

    def is_stored(self, key: OffloadKey) -> bool:
        return key in self._slot_of and key not in self._storing and key not in self._doomed

    def stored_mask(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [self.is_stored(k) for k in keys]

    def ref_count(self, key: OffloadKey) -> int:
        return self._refs.get(key, 0)

    def slot_of(self, key: OffloadKey) -> int | None:
        return self._slot_of.get(key)

    # -- loads --------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        n = 0
        for key in keys:
            if not self.is_stored(key):
                break
            n += 1
        return n

    def prepare_load(self, keys: Sequence[OffloadKey]) -> DiskLoadStoreSpec:
        keys = list(keys)
        for key in keys:
            if not self.is_stored(key):
                raise ValueError(f"cannot load key {key.hex()} from disk: not stored")
        refs, lru = self._refs, self._lru
        for key in keys:
            r = refs.get(key, 0)
            if r == 0:
                del lru[key]
            refs[key] = r + 1
        return DiskLoadStoreSpec([self._slot_of[k] for k in keys], keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        unpinned = release_pins(self._refs, list(keys))
        gone = [k for k in unpinned if k in self._doomed]
        if gone:
            self._doomed.difference_update(gone)
            self._forget(gone)
        # A load is a use: tail first, so the chain's head ends most recent.
        for key in reversed(unpinned):
            if key in self._slot_of:
                self._lru[key] = None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        lru = self._lru
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)

    # -- stores -------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        slot_of = self._slot_of
        unique = list(dict.fromkeys(keys))
        new = [k for k in unique if k not in slot_of]
        if not new:
            return PrepareStoreOutput([], DiskLoadStoreSpec([], []), [], DiskLoadStoreSpec([], []))
        need = len(new) - len(self._free)
        victims: list[OffloadKey] = []
        if need > 0:
            # Stored keys of this very store are kept (they are the chain being written).
            protect = {k for k in unique if k in self._lru}
            if need > len(self._lru) - len(protect):
                return None
            for key in self._lru:
                if key not in protect:
                    victims.append(key)
                    if len(victims) == need:
                        break
            for key in victims:
                del self._lru[key]
        slots, victim_slots = reassign_slots(slot_of, self._free, victims, new)
        if victims and self.enable_events:
            self._events.append(OffloadingEvent(victims, DISK_MEDIUM, removed=True))
        self._storing.update(new)
        return PrepareStoreOutput(
            new,
            DiskLoadStoreSpec(slots, new),
            victims,
            DiskLoadStoreSpec(victim_slots, victims),
        )

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        keys = finish_stores(self._storing, keys)
        if not keys:
            return
        if success:
            for key in reversed(keys):
                self._lru[key] = None
            if self.enable_events:
                self._events.append(OffloadingEvent(keys, DISK_MEDIUM, removed=False))
        else:
            self._free.extend(self._slot_of.pop(k) for k in keys)

    # -- drops --------------------------------------------------------------

    def drop(self, keys: Sequence[OffloadKey]) -> None:
        now: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            if not self.is_stored(key):
                continue
            if key in self._refs:
                self._doomed.add(key)
            else:
                del self._lru[key]
                now.append(key)
        self._forget(now)

    def _forget(self, keys: list[OffloadKey]) -> None:
        if not keys:
            return
        self._free.extend(self._slot_of.pop(k) for k in keys)
        if self.enable_events:
            self._events.append(OffloadingEvent(keys, DISK_MEDIUM, removed=True))

    # -- reset --------------------------------------------------------------

    def can_reset_cache(self) -> bool:
        return not self._storing and not self._refs

    def reset_cache(self, force: bool = False) -> bool:
        """See ``OffloadingManager.reset_cache``; the disk store is cleared first."""
        if not force and not self.can_reset_cache():
            return False
        if self.clear_store is not None:
            # Before forgetting: if clearing fails, the index still matches the store.
            self.clear_store()
        stored = [k for k in self._slot_of if k not in self._storing]
        self._slot_of.clear()
        self._storing.clear()
        self._refs.clear()
        self._lru.clear()
        self._doomed.clear()
        self._free = list(range(self._num_blocks - 1, -1, -1))
        if stored and self.enable_events:
            self._events.append(OffloadingEvent(stored, DISK_MEDIUM, removed=True))
        return True

    # -- events -------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events
