"""The CPU tier's manager: ``num_blocks`` slots of pinned host memory, by slot id.

State per key (see ``kvoffload.offload.base`` for the life cycle):

- ``_slot_of``: every key the tier holds, stored or being stored, and its slot;
- ``_storing``: keys whose store is in flight (not loadable, not evictable);
- ``_refs``: load pins of stored keys (present only while > 0).

Invariants: the slots of ``_slot_of`` and ``_free`` are disjoint and together
are ``range(num_blocks)``; the policy's resident keys are exactly the stored
keys (``_slot_of`` minus ``_storing``) and its pinned keys exactly ``_refs``.
Every operation costs O(len(keys)) (amortised, in the policy): nothing scans
all stored blocks.

With a ``group_layout`` of two groups or more (hybrid models: one key per
chunk per group), the policy is wrapped in ``ChunkUnitPolicy``: the policy
ranks chunks, a chunk's keys are evicted together, and windowed groups' keys
that no hit boundary can reach go first (see ``kvoffload.offload.chunk_units``).
With one group or none, nothing is wrapped: decisions and speed are the
per-key ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import takewhile
from typing import cast

from kvoffload.offload.base import (
    CPULoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    finish_stores,
    reassign_slots,
    release_pins,
)
from kvoffload.offload.chunk_units import ChunkUnitPolicy, GroupLayout, uses_chunk_units
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.registry import make_policy

_sink: deque[object] = deque(maxlen=0)
_drain: Callable[[Iterable[object]], None] = _sink.extend  # a map's effects, at C speed


#: Queue hints (blocks waiting requests need are kept, farthest need evicted first) around
#: chain-aware LRU with an admission duel (all / second sighting / BIP against loops).
DEFAULT_CACHE_POLICY = "queue_arms"


class CPUOffloadingManager(OffloadingManager):
    """Slots, pins and events of the CPU tier; the eviction order is ``cache_policy``'s.

    Events (only with ``enable_events``), in the order things happened: one
    ``removed=True`` event per ``prepare_store`` that evicted (victims in
    eviction order), one ``removed=False`` event per successful
    ``complete_store`` (its keys), one ``removed=True`` event per
    ``reset_cache`` (every key it forgot). A failed store leaves no event: its
    keys were never announced.

    ``prepare_store`` returns, besides the contract's fields, ``evicted_spec``:
    the slots the evicted keys occupied, so a tiered manager above can copy
    them to a lower tier before this store's transfer overwrites them.

    ``group_layout``: the KV cache groups, indexed by a key's group index
    (``GroupLayout(kind, sliding_window, tokens_per_chunk, slot_bytes)``). With
    two groups or more a store may evict a few more keys than it needs (a
    chunk goes whole).
    """

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str | type[CachePolicy] = DEFAULT_CACHE_POLICY,
        enable_events: bool = False,
        group_layout: Sequence[GroupLayout] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self.cache_policy = cache_policy
        self.group_layout: tuple[GroupLayout, ...] | None = (
            tuple(group_layout) if group_layout is not None else None
        )
        self.policy: CachePolicy = self._new_policy()
        self._hints = type(self.policy).hint_parent is not CachePolicy.hint_parent
        self.enable_events = enable_events
        # Lowest slot ids first: pop() from the end.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._slot_of: dict[OffloadKey, int] = {}
        self._storing: set[OffloadKey] = set()
        self._refs: dict[OffloadKey, int] = {}
        self._events: list[OffloadingEvent] = []
        # Queue hints outlive a reset (the requests still wait): re-announced to the new policy.
        self._queued: dict[str, list[OffloadKey]] = {}

    def _new_policy(self) -> CachePolicy:
        policy = make_policy(self.cache_policy, self._num_blocks)
        if uses_chunk_units(self.group_layout):
            policy = ChunkUnitPolicy(policy, cast(tuple[GroupLayout, ...], self.group_layout))
        # Set here, not per call: the per-key path pays nothing for the unit layer.
        self._units = policy if isinstance(policy, ChunkUnitPolicy) else None
        return policy

    # -- introspection ------------------------------------------------------

    @property
    def medium(self) -> str:
        return CPULoadStoreSpec.medium()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_evictable_blocks(self) -> int:
        return self.policy.num_evictable()

    def num_stored_blocks(self) -> int:
        """Keys stored and ready (pinned included, stores in flight excluded)."""
        return len(self._slot_of) - len(self._storing)

    def is_stored(self, key: OffloadKey) -> bool:
        return key in self._slot_of and key not in self._storing

    def is_storing(self, key: OffloadKey) -> bool:
        return key in self._storing

    def ref_count(self, key: OffloadKey) -> int:
        """Load pins currently held on ``key``."""
        return self._refs.get(key, 0)

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot of a stored or storing key, None for an unknown one."""
        return self._slot_of.get(key)

    # -- loads --------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        slot_of, storing = self._slot_of, self._storing
        if not storing:
            # No store in flight: the leading keys the tier holds, counted in C.
            n = len(list(takewhile(slot_of.__contains__, keys)))
        else:
            n = 0
            for key in keys:
                if key not in slot_of or key in storing:
                    break
                n += 1
        if self._hints and 0 < n < len(keys):
            self.policy.hint_parent(keys[n], keys[n - 1])
        return n

    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        keys = list(keys)
        slot_of, storing, refs = self._slot_of, self._storing, self._refs
        slots = list(map(slot_of.get, keys))  # (checked before anything changes)
        if None in slots or not storing.isdisjoint(keys):
            bad = next(k for k in keys if k not in slot_of or k in storing)
            raise ValueError(f"cannot load key {bad.hex()}: not stored (or still storing)")
        once = dict.fromkeys(keys, 1)
        if len(once) == len(keys) and refs.keys().isdisjoint(once):
            # The usual load: distinct keys, none pinned yet (no per-key loop).
            refs.update(once)
            newly_pinned = keys
        else:
            newly_pinned = []
            for key in keys:
                r = refs.get(key, 0)
                if r == 0:
                    newly_pinned.append(key)
                refs[key] = r + 1
        if newly_pinned:
            self.policy.pin(newly_pinned)
        self.policy.access(keys)
        return CPULoadStoreSpec(cast("list[int]", slots))  # no None: checked above

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        keys = list(keys)
        refs = self._refs
        if list(map(refs.get, keys)).count(1) == len(keys) == len(set(keys)):
            # Distinct keys pinned once each (the usual load): all unpinned.
            _drain(map(refs.pop, keys))
            unpinned = keys
        else:
            unpinned = release_pins(refs, keys)
        if unpinned:
            self.policy.unpin(unpinned)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        slot_of, storing = self._slot_of, self._storing
        known = [k for k in keys if k in slot_of and k not in storing]
        if known:
            self.policy.access(known)

    # -- stores -------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        slot_of = self._slot_of
        unique = list(dict.fromkeys(keys))
        new = (
            unique if slot_of.keys().isdisjoint(unique) else [k for k in unique if k not in slot_of]
        )
        if self._units is not None:
            return self._prepare_store_units(self._units, unique, new)
        if self._hints and len(new) < len(unique):
            self._hint_continuations(unique)
        if not new:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [], CPULoadStoreSpec([]))
        need = len(new) - len(self._free)
        policy = self.policy
        victims: list[OffloadKey] = []
        if need > 0:
            # Stored keys of this very store are kept: evicting them to make
            # room for their own chain would be self-defeating. (All new: none.)
            protect = (
                []
                if new is unique
                else [
                    k
                    for k in unique
                    if k in slot_of and k not in self._storing and k not in self._refs
                ]
            )
            if need > policy.num_evictable() - len(protect):
                return None
            if protect:
                policy.pin(protect)
            victims = policy.evict(need, new)
            if protect:
                policy.unpin(protect)
        else:
            policy.evict(0, new)
        slots, victim_slots = reassign_slots(slot_of, self._free, victims, new)
        if victims and self.enable_events:
            self._events.append(OffloadingEvent(victims, self.medium, removed=True))
        self._storing.update(new)
        return PrepareStoreOutput(
            new, CPULoadStoreSpec(slots), victims, CPULoadStoreSpec(victim_slots)
        )

    def _prepare_store_units(
        self, units: ChunkUnitPolicy, unique: list[OffloadKey], new: list[OffloadKey]
    ) -> PrepareStoreOutput | None:
        """``prepare_store`` with several groups: the unit layer picks victims (chunks whole)."""
        if not new:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [], CPULoadStoreSpec([]))
        # Keys of this store still in flight from another job are neither victims nor room.
        storing = self._storing
        offered = unique if storing.isdisjoint(unique) else [k for k in unique if k not in storing]
        victims = units.make_room(len(new) - len(self._free), offered, new)
        if victims is None:
            return None
        slots, victim_slots = reassign_slots(self._slot_of, self._free, victims, new)
        if victims and self.enable_events:
            self._events.append(OffloadingEvent(victims, self.medium, removed=True))
        storing.update(new)
        return PrepareStoreOutput(
            new, CPULoadStoreSpec(slots), victims, CPULoadStoreSpec(victim_slots)
        )

    def admit(self, keys: Sequence[OffloadKey]) -> list[bool] | None:
        """The policy's admission (``CachePolicy.admit``) for the keys not held yet."""
        if type(self.policy).admit is CachePolicy.admit:
            return None  # the policy stores every key: skip the scan for new keys
        slot_of = self._slot_of
        unique = list(dict.fromkeys(keys))
        whole = len(unique) == len(keys) and slot_of.keys().isdisjoint(unique)
        new = unique if whole else [k for k in unique if k not in slot_of]
        if not new:
            return None
        flags = self.policy.admit(new, len(self._storing))
        if flags is None or all(flags):
            return None
        if whole:  # the usual offer: distinct keys, none held; the flags are the answer
            return list(flags)
        declined = {k for k, f in zip(new, flags) if not f}
        return [k not in declined for k in keys]

    def _hint_continuations(self, keys: list[OffloadKey]) -> None:
        """Tell the policy which new keys continue a stored one (see ``hint_parent``)."""
        slot_of, storing, hint = self._slot_of, self._storing, self.policy.hint_parent
        prev: OffloadKey | None = None
        for key in keys:
            if prev is not None and key not in slot_of:
                hint(key, prev)
            prev = key if key in slot_of and key not in storing else None

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        storing = self._storing
        done = list(dict.fromkeys(keys))
        if storing.issuperset(done):
            storing.difference_update(done)
            keys = done
        else:
            keys = finish_stores(storing, keys)
        if not keys:
            return
        if success:
            self.policy.insert(keys)
            if self.enable_events:
                self._events.append(OffloadingEvent(keys, self.medium, removed=False))
        else:
            slot_of = self._slot_of
            self._free.extend(slot_of.pop(k) for k in keys)
            if self._units is not None:
                self._units.abandon(keys)

    # -- hints (forwarded to the policy, which owns what they mean) --------------

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        keys = list(keys)
        self._queued[request_id] = keys
        self.policy.hint_queued(request_id, keys)

    def hint_dequeued(self, request_id: str) -> None:
        if self._queued.pop(request_id, None) is not None:
            self.policy.hint_dequeued(request_id)

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.hint_continues(list(keys))

    # -- reset --------------------------------------------------------------

    def can_reset_cache(self) -> bool:
        return not self._storing and not self._refs

    def reset_cache(self, force: bool = False) -> bool:
        if not force and not self.can_reset_cache():
            return False
        stored = [k for k in self._slot_of if k not in self._storing]
        self.policy = self._new_policy()
        for request_id, queued in self._queued.items():
            self.policy.hint_queued(request_id, queued)
        self._free = list(range(self._num_blocks - 1, -1, -1))
        self._slot_of.clear()
        self._storing.clear()
        self._refs.clear()
        if stored and self.enable_events:
            self._events.append(OffloadingEvent(stored, self.medium, removed=True))
        return True

    # -- events -------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events
