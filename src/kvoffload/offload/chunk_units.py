"""A chunk's keys as one unit: the policy layer for tiers holding several KV cache groups.

With hybrid models a tier holds one key per chunk per group
(``OffloadKey`` = block hash + 4-byte group index). A hit at a chunk
boundary needs every full-attention group's key of every chunk before it
and each windowed group's keys of the last few chunks before it: evicting
one group's key of such a chunk loses the hit for all groups. Per-key
policies do exactly that (they rank each group's key on its own), so this
layer sits between ``CPUOffloadingManager`` and its policy and shows the
policy one *unit* per chunk (the block hash) instead of one key per group.

Keys of the tier, by state (``ChunkUnitPolicy`` keeps the first two):

- *held*: stored keys a hit can use. A unit is resident in the inner policy
  exactly while it holds at least one held key, and is evicted whole (every
  stored key of its chunk, dead ones included).
- *dead*: stored keys of a windowed group (sliding window, chunked local
  attention, Mamba state) that no known boundary can reach: a hit ending at
  chunk boundary ``e`` needs a windowed group's keys of chunks
  ``[e - reach, e)`` only. Known boundaries are the end of every store's run
  of a group's keys (a request's prompt ends there: a later turn or the same
  prompt hits there) and every place a lookup or a store continued a stored
  chain (requests diverged there). Dead keys are evicted first, oldest
  first; a dead key that is loaded, touched or reached by a new boundary is
  held again ("revived").
- *pending*: keys of a store in flight. A unit with a pending or pinned
  key is *busy*: pinned in the inner policy, so never evicted while part of
  its chunk is being written or read.

Invariants (checked by tests/offload/test_chunk_units*.py):

- ``num_evictable()`` is the number of slots one store can take by eviction:
  the dead keys not pinned plus the held keys of resident units that are not
  busy. It equals ``len(_dead) + _idle``.
- A store's victims are dead keys first (oldest first), then whole units in
  the inner policy's order; a unit evicted by the inner policy loses all its
  stored keys at once. No other key is ever dropped alone.
- The inner policy sees each unit as one key and the usual ``CachePolicy``
  guarantees (insert of a new unpinned unit, pin of a resident unpinned one,
  ``evict(n)`` with ``n <= num_evictable()``).

Every operation costs O(keys of the call) plus O(reach) per boundary
(walking back along chain links): nothing scans the stored keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import cast

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.chunk_chains import SUFFIX_BYTES as _SUFFIX
from kvoffload.offload.chunk_chains import ChunkChains
from kvoffload.offload.group_layout import (
    CHUNKED_LOCAL,
    FULL_ATTENTION,
    GROUP_KINDS,
    MAMBA,
    SLIDING_WINDOW,
    GroupLayout,
    uses_chunk_units,
)
from kvoffload.offload.policies import CachePolicy

__all__ = [
    "CHUNKED_LOCAL",
    "FULL_ATTENTION",
    "GROUP_KINDS",
    "MAMBA",
    "SLIDING_WINDOW",
    "ChunkUnitPolicy",
    "GroupLayout",
    "uses_chunk_units",
]


class ChunkUnitPolicy(CachePolicy):
    """``inner`` ranks chunks (one unit key per block hash); this layer maps keys to units.

    Used by ``CPUOffloadingManager`` when it holds several groups: the manager
    calls ``make_room`` instead of ``evict`` and ``abandon`` for a failed
    store, and the ``CachePolicy`` methods otherwise. ``len`` and
    ``num_evictable`` count keys (slots), not units. Units are kept as bytes
    and handed to ``inner`` as its keys with a cast (``OffloadKey`` is a
    NewType of bytes: no copy, no call per unit).
    """

    name = "chunk_units"

    def __init__(self, inner: CachePolicy, layout: Sequence[GroupLayout]) -> None:
        super().__init__(inner.capacity)
        self.inner = inner
        self.layout = tuple(layout)
        chains = self._chains = ChunkChains(self.layout)
        # Aliases (the chains never rebind them): the hot paths read them as locals.
        self._reach = chains.reach
        self._link_suffixes = chains.link_suffixes
        self._max_reach = chains.max_reach
        self._prev = chains.prev
        self._boundary = chains.boundary
        cls = type(inner)
        self._inner_hints = cls.hint_parent is not CachePolicy.hint_parent
        self._inner_admits = cls.admit is not CachePolicy.admit
        self._reset_state()

    def _reset_state(self) -> None:
        self._stored: set[OffloadKey] = set()
        self._members: dict[bytes, list[OffloadKey]] = {}  # unit -> its stored keys
        self._nheld: dict[bytes, int] = {}  # unit -> held keys (> 0: resident in inner)
        self._busy: dict[bytes, int] = {}  # unit -> pending + pinned keys (> 0 only)
        self._pending: set[OffloadKey] = set()
        self._dead: dict[OffloadKey, None] = {}  # dead, not pinned; oldest first
        self._dead_pinned: set[OffloadKey] = set()
        self._idle = 0  # held keys of resident units that are not busy
        self._chains.clear()
        self._units_max = max(len(self.layout), 1)  # most stored keys one unit can hold
        # The inner policy counts chunks, not slots (its capacity is the slots'): told
        # again after a clear, which rebuilds it.
        self.inner.hint_units()

    def clear(self) -> None:
        self.inner.clear()
        self._reset_state()

    # -- introspection ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, key: object) -> bool:
        return key in self._stored

    def num_evictable(self) -> int:
        return len(self._dead) + self._idle

    def is_dead(self, key: OffloadKey) -> bool:
        """Whether ``key`` is stored and out of reach of every known boundary."""
        return key in self._dead or key in self._dead_pinned

    def dead_keys(self) -> list[OffloadKey]:
        """Dead keys not pinned, in eviction order."""
        return list(self._dead)

    def num_units(self) -> int:
        """Chunks with at least one stored key."""
        return len(self._members)

    # -- busy units (pinned in the inner policy) -------------------------------

    def _busy_up_all(self, keys: Sequence[OffloadKey]) -> None:
        """One more busy key per key's unit; units that became busy: one inner ``pin``."""
        busy, nheld = self._busy, self._nheld
        to_pin: list[bytes] = []
        for key in keys:
            unit = key[:-_SUFFIX]
            b = busy.get(unit, 0)
            busy[unit] = b + 1
            if b == 0 and unit in nheld:
                to_pin.append(unit)
        if to_pin:
            self.inner.pin(cast("list[OffloadKey]", to_pin))
            self._idle -= sum(map(nheld.__getitem__, to_pin))

    def _busy_down_all(self, keys: Sequence[OffloadKey]) -> None:
        """One busy key less per key's unit; units that became idle: one inner ``unpin``."""
        busy, nheld = self._busy, self._nheld
        to_unpin: list[bytes] = []
        for key in keys:
            unit = key[:-_SUFFIX]
            b = busy[unit] - 1
            if b:
                busy[unit] = b
            else:
                del busy[unit]
                if unit in nheld:
                    to_unpin.append(unit)
        if to_unpin:
            self.inner.unpin(cast("list[OffloadKey]", to_unpin))
            self._idle += sum(map(nheld.__getitem__, to_unpin))

    # -- held / dead -------------------------------------------------------------

    def _hold(self, unit: bytes, fresh: dict[bytes, None]) -> None:
        """Count one more held key of ``unit``; a unit that just became resident joins ``fresh``
        (``_enter_inner`` counts its idle keys then)."""
        n = self._nheld.get(unit, 0)
        self._nheld[unit] = n + 1
        if n == 0:
            fresh[unit] = None
        elif unit not in fresh and unit not in self._busy:
            self._idle += 1

    def _enter_inner(self, units: list[bytes]) -> None:
        """Units that just became resident: insert (chain order), then pin the busy ones."""
        self.inner.insert(cast("list[OffloadKey]", units))
        busy = [u for u in units if u in self._busy]
        if busy:
            self.inner.pin(cast("list[OffloadKey]", busy))
        nheld = self._nheld
        self._idle += sum(nheld[u] for u in units if u not in self._busy)

    def _revive(self, key: OffloadKey) -> None:
        """A dead key is reached by a boundary or used: it becomes held."""
        if key in self._dead:
            del self._dead[key]
        elif key in self._dead_pinned:
            self._dead_pinned.discard(key)
        else:
            return
        fresh: dict[bytes, None] = {}
        self._hold(key[:-_SUFFIX], fresh)
        if fresh:
            self._enter_inner(list(fresh))

    def _mark_back(self, unit: bytes, steps: int) -> None:
        """A boundary follows ``unit``: revive windowed keys of the ``steps`` chunks up to it."""
        reach, prev, dead_any = self._reach, self._prev, self._dead or self._dead_pinned
        for back in range(steps):
            if dead_any:
                for suffix, r in reach.items():
                    if back < r:
                        self._revive(OffloadKey(unit + suffix))
            nxt = prev.get(unit)
            if nxt is None:
                return
            unit = nxt

    def _drop_dead(self, keys: list[OffloadKey]) -> None:
        """Evict these dead keys (already out of ``_dead``), in order; a unit left with no
        stored key and not busy is forgotten."""
        self._stored.difference_update(keys)
        members, busy = self._members, self._busy
        prev, boundary = self._prev, self._boundary
        for key in keys:
            unit = key[:-_SUFFIX]
            group = members[unit]
            group.remove(key)
            if not group:
                del members[unit]
                if unit not in busy:
                    prev.pop(unit, None)
                    boundary.discard(unit)

    # -- CachePolicy: what the manager reports ---------------------------------

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """Stores completed: pending keys become held, or dead when out of reach."""
        pending = self._pending
        if pending.issuperset(keys):
            pending.difference_update(keys)
            self._busy_down_all(keys)
        else:
            done = [k for k in keys if k in pending]
            pending.difference_update(done)
            self._busy_down_all(done)
        live = self._chains.classify(keys)
        fresh: dict[bytes, None] = {}
        stored, members, dead = self._stored, self._members, self._dead
        stored.update(keys)
        units_max = self._units_max
        for key, is_live in zip(keys, live):
            unit = key[:-_SUFFIX]
            group = members.get(unit)
            if group is None:
                members[unit] = [key]
            else:
                group.append(key)
                if len(group) > units_max:
                    units_max = len(group)
            if is_live:
                self._hold(unit, fresh)
            else:
                dead[key] = None
        self._units_max = units_max
        if fresh:
            self._enter_inner(list(fresh))

    def access(self, keys: Sequence[OffloadKey]) -> None:
        """A hit used ``keys``: dead ones among them are held again; their units are used."""
        if self._dead or self._dead_pinned:
            for key in keys:
                self._revive(key)
        units = [u for u in dict.fromkeys(k[:-_SUFFIX] for k in keys) if u in self._nheld]
        if units:
            self.inner.access(cast("list[OffloadKey]", units))

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        dead = self._dead
        if dead and not dead.keys().isdisjoint(keys):
            for key in keys:
                if key in dead:
                    del dead[key]
                    self._dead_pinned.add(key)
        self._busy_up_all(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        pinned = self._dead_pinned
        if pinned and not pinned.isdisjoint(keys):
            for key in keys:
                if key in pinned:
                    pinned.discard(key)
                    self._dead[key] = None
        self._busy_down_all(keys)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        """``CachePolicy.evict`` for callers without ``make_room``; may return more than n."""
        victims = self.make_room(n, incoming, incoming)
        if victims is None:
            raise ValueError(f"cannot evict {n} keys: {self.num_evictable()} evictable")
        return victims

    # -- the manager's store path ----------------------------------------------

    def make_room(
        self, need: int, offered: Sequence[OffloadKey], new: Sequence[OffloadKey]
    ) -> list[OffloadKey] | None:
        """Evict at least ``need`` keys for a store of ``new`` (distinct, not held yet).

        ``offered``: the store's distinct keys in chain order (``new`` and keys
        already stored, which are kept). From here until ``insert`` or
        ``abandon`` the new keys are pending and their units busy (so a chunk
        is not evicted to make room for its own other groups). Returns the
        victims (dead keys first, then whole units; possibly a few more than
        ``need``: a unit goes whole), or None, with nothing evicted or pending,
        when ``need`` keys cannot be freed without touching busy units or the
        store's own stored keys.
        """
        self._pending.update(new)
        self._busy_up_all(new)
        if len(new) < len(offered):
            self._hint_continuations(offered)
        # The store's stored keys stay: their units are busy, their dead keys set aside.
        stored = self._stored
        kept = [k for k in offered if k in stored]
        set_aside = [k for k in kept if k in self._dead]
        for key in set_aside:
            del self._dead[key]
        self._busy_up_all(kept)
        units_new = [u for u in dict.fromkeys(k[:-_SUFFIX] for k in new) if u not in self._nheld]
        victims: list[OffloadKey] | None
        if need > self.num_evictable():
            victims = None
        else:
            victims = self._evict(need, units_new) if need > 0 else []
            if need <= 0 and new:
                self.inner.evict(0, cast("list[OffloadKey]", units_new))
        self._busy_down_all(kept)
        for key in set_aside:
            self._dead[key] = None
        if victims is None:
            self.abandon(new)
        return victims

    def _evict(self, need: int, units_new: list[bytes]) -> list[OffloadKey]:
        victims: list[OffloadKey] = []
        dead = self._dead
        if need > 0 and dead:
            # The oldest dead keys first (insertion order), as many as needed, in one batch:
            # one key at a time cost a call and a fresh iterator per key.
            victims = list(islice(dead, need))
            for key in victims:
                del dead[key]
            self._drop_dead(victims)
            need -= len(victims)
        incoming: Sequence[bytes] = units_new
        told = False
        members, nheld, stored = self._members, self._nheld, self._stored
        prev, boundary = self._prev, self._boundary
        while need > 0:
            # At most _units_max keys per unit: this many units never frees more than needed
            # by a whole unit's worth, and never asks for more units than are evictable.
            k = -(-need // self._units_max)
            # Each unit the inner policy evicted (resident, not busy) loses every stored
            # key. Inlined (was one call per unit): under eviction pressure a store drops
            # thousands of units. ``dead`` is empty here (the loop above drained it
            # before any unit goes), so no key of these units is dead.
            dropped_held = 0
            for unit in self.inner.evict(k, cast("Sequence[OffloadKey]", incoming)):
                keys = members.pop(unit)
                dropped_held += nheld.pop(unit)
                stored.difference_update(keys)
                prev.pop(unit, None)
                boundary.discard(unit)
                victims.extend(keys)
                need -= len(keys)
            self._idle -= dropped_held
            incoming, told = (), True
        if not told:
            self.inner.evict(0, cast("list[OffloadKey]", units_new))
        return victims

    def abandon(self, keys: Iterable[OffloadKey]) -> None:
        """A store of ``keys`` failed (or was refused): they are no longer pending."""
        pending = self._pending
        done = [k for k in keys if k in pending]
        pending.difference_update(done)
        self._busy_down_all(done)
        members, busy = self._members, self._busy
        for key in done:
            unit = key[:-_SUFFIX]
            if unit not in members and unit not in busy:
                self._chains.forget(unit)

    def _hint_continuations(self, offered: Sequence[OffloadKey]) -> None:
        """New keys that continue stored ones: the chain diverges or goes on there."""
        stored, pending = self._stored, self._pending
        prev: OffloadKey | None = None
        for key in offered:
            if prev is not None and key in pending:
                self.hint_parent(key, prev)
            prev = key if key in stored else None

    # -- hints --------------------------------------------------------------------

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        """``parent`` is stored and ``child`` follows it: a hit boundary is right after it."""
        unit, child_unit = parent[:-_SUFFIX], child[:-_SUFFIX]
        if unit == child_unit:
            return
        known = unit in self._members
        if known and (child_unit in self._members or child_unit in self._busy):
            self._chains.link(child_unit, unit, parent[-_SUFFIX:])
        if known and self._reach:
            self._boundary.add(unit)
            self._mark_back(unit, self._max_reach)
        if self._inner_hints and unit in self._nheld:
            self.inner.hint_parent(cast(OffloadKey, child_unit), cast(OffloadKey, unit))

    def _units(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        # OffloadKey is a NewType: a cast, not one call per unit.
        return cast(list[OffloadKey], list(dict.fromkeys([k[:-_SUFFIX] for k in keys])))

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        """The inner policy protects the request's chunks; its hit boundary keeps its window.

        The request will hit where its chain stops being stored: the windowed
        keys before that point are what its hit needs, dead or not.
        """
        if self._reach:
            self._mark_queued_boundary(keys)
        self.inner.hint_queued(request_id, self._units(keys))

    def _mark_queued_boundary(self, keys: Sequence[OffloadKey]) -> None:
        unit = self._chains.queued_boundary(keys, self._stored)
        if unit is not None:
            # The whole chain may be stored: the hit then stops one chunk earlier too.
            self._mark_back(unit, self._max_reach + 1)

    def hint_dequeued(self, request_id: str) -> None:
        self.inner.hint_dequeued(request_id)

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.hint_continues(self._units(keys))

    def _chunks_in_flight(self) -> int:
        """Chunks of stores in flight that the inner policy does not hold yet: the room
        those stores take in its count (it ranks chunks; the manager counts their slots,
        up to one per group each). O(pending keys), only while stores are in flight."""
        return len({k[:-_SUFFIX] for k in self._pending} - self._nheld.keys())

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        """The inner policy's admission of the chunks not held yet; a chunk is admitted whole.
        ``in_flight`` (the manager's slots) reaches the inner policy as chunks."""
        if not self._inner_admits:
            return None
        known = self._members
        fresh = [u for u in self._units(keys) if u not in known and u not in self._busy]
        if not fresh:
            return None
        if in_flight:
            in_flight = self._chunks_in_flight()
        flags = self.inner.admit(fresh, in_flight)
        if flags is None:
            return None
        declined = {u for u, f in zip(fresh, flags) if not f}
        if not declined:
            return None
        return [k[:-_SUFFIX] not in declined for k in keys]
