"""Queue-aware eviction: blocks that waiting requests need are kept, nearest need first.

A loaded server holds requests that have arrived but not run, and it has
already hashed their prompts. The manager forwards that queue as hints
(``hint_queued(request_id, keys)`` on arrival, ``hint_dequeued`` once the
request is scheduled, aborted or finished). This wrapper acts on them around
an inner policy that orders everything else:

- a resident key that some queued request needs is *held*: pinned in the
  inner policy (which still sees its reads), so the inner policy's victims
  (whose next use, if any, lies beyond the known queue) always go first, as
  Belady's rule says;
- when only held keys are left to evict, the one needed farthest ahead goes
  (the largest queue position of its nearest waiting request; within one
  request, the chain's tail before its head, since a lookup stops at the
  first missing block);
- admission follows the queue: a new key a queued request needs is held at
  once, whatever the inner policy's admission filter thinks of it; an
  unneeded one is the inner policy's, which evicts it first while the tier is
  full of needed keys. When a new key could only come in by pushing out a
  held key, it must be needed sooner than that key, else it and the rest of
  its store are not stored (Belady's bypass: a loop whose every turn is queued
  would otherwise evict its own stored head to store its tail);
- when a request leaves the queue its keys that nobody else waits for are
  unpinned in the inner policy, as just used (the request read them);
- ``hint_continues(keys)`` (a client says the conversation goes on) marks
  keys; a marked resident key is pinned in the inner policy too, but is
  evicted before any held key, oldest mark first, and at most half the tier
  is kept that way (a soft priority, not a reservation).

Costs: each hint is O(keys of the request) amortised (a held key whose
nearest need changes is marked dirty, and pushed on a heap only when a held
key must be evicted; stale entries are dropped lazily and compacted against
the pushes). Without hint state (no waiting request, no continue mark: the
usual case, and every tier whose engine sends no hints) the wrapper is
transparent: ``insert``, ``access``, ``pin``, ``unpin``, ``hint_parent`` and ``num_evictable`` are
the inner policy's own bound methods (set on the instance, dropped again when
a hint arrives), and ``admit`` / ``evict`` pass straight through. Nothing scans
the resident keys. Invariants: the resident keys are the inner policy's; held
and marked keys (disjoint) are pinned there, and so are the manager's pins of
other keys; ``_pins`` is the manager's pins among held and marked keys (so it
is empty without hint state); a held key has a waiting request;
``num_evictable`` = the inner policy's + held and marked keys the manager has
not pinned.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.default.policy_duel import PolicyDuel, fit_room

#: What the wrapper hands straight to the inner policy while it holds no hint state.
_FORWARDED = ("insert", "access", "pin", "unpin", "hint_parent", "num_evictable")


class QueueAwarePolicy(CachePolicy):
    """Queue and session hints around ``inner_cls`` (set by subclasses), which must have
    ``discard(key)``: forget a resident key, pinned or not (a protected victim), and
    ``is_pinned(key)``: whether a resident key is pinned."""

    inner_cls: ClassVar[type[CachePolicy]]
    #: At most this share of the tier is kept out of the inner policy by continue marks.
    continue_share: ClassVar[float] = 0.5

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.inner = self.inner_cls(capacity)
        self._seq = 0
        self._reqs: dict[str, tuple[int, list[OffloadKey]]] = {}
        # Per key the (queue seq, block position) of each waiting request that needs it,
        # in queue order (seqs only grow, so appends keep it sorted).
        # (Lists: short, and cheaper to create than deques; the head goes first.)
        self._wants: dict[OffloadKey, list[tuple[int, int]]] = {}
        self._held: set[OffloadKey] = set()  # resident, needed, outside the inner policy
        self._heap: list[tuple[int, int, OffloadKey]] = []  # (-seq, -pos, key), lazily stale
        # Held keys whose nearest need changed since the heap last saw them: pushed only
        # when a held key must be evicted (rare on a large tier), once however often it changed.
        self._dirty: set[OffloadKey] = set()
        self._marks: OrderedDict[OffloadKey, None] = OrderedDict()  # continue marks, oldest first
        self._marked: OrderedDict[OffloadKey, None] = OrderedDict()  # resident, marked, outside
        self._pins: set[OffloadKey] = set()  # manager pins of held and marked keys
        self._max_marked = int(self.continue_share * capacity)
        self._plain = False
        self._sync()

    def _sync(self) -> None:
        """Forward to the inner policy while there is no hint state, stop when there is.

        No waiting request and no continue mark leave nothing held or marked, so the
        methods named in ``_FORWARDED`` would only pass through: they become the inner
        policy's bound methods on the instance (one call frame and the wrapper's
        bookkeeping fewer per manager call). ``admit`` and ``evict`` stay methods."""
        plain = not self._reqs and not self._marks
        if plain == self._plain:
            return
        self._plain = plain
        attrs = self.__dict__
        if plain:
            inner = self.inner
            for name in _FORWARDED:
                attrs[name] = getattr(inner, name)
        else:
            for name in _FORWARDED:
                del attrs[name]

    # -- introspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.inner)  # held and marked keys are in it, pinned

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def num_evictable(self) -> int:
        return self.inner.num_evictable() + len(self._held) + len(self._marked) - len(self._pins)

    def is_held(self, key: OffloadKey) -> bool:
        """Whether ``key`` is resident and protected for a waiting request."""
        return key in self._held

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        self.inner.hint_parent(child, parent)

    def hint_units(self) -> None:
        self.inner.hint_units()

    # -- moving keys between the inner policy and the protected sets ----------------------

    # A held or marked key stays in the inner policy, pinned there (so it is never the
    # inner policy's victim, and the inner policy still sees its reads); the manager's
    # own pins of such keys are only counted. ``_shield`` / ``_release`` move keys in
    # and out of that state; a protected victim is ``discard``-ed from the inner policy.

    def _shield(self, keys: list[OffloadKey]) -> None:
        """Ordinary resident keys of the inner policy become held or marked (the inner
        policy's pins of ordinary keys are the manager's: those are counted)."""
        is_pinned = self.inner.is_pinned  # type: ignore[attr-defined]
        pinned = [k for k in keys if is_pinned(k)]
        if pinned:
            self._pins.update(pinned)
            keys = [k for k in keys if k not in self._pins]
        if keys:
            self.inner.pin(keys)

    def _release(self, keys: list[OffloadKey]) -> None:
        """Held or marked resident keys become ordinary again, as just used (chain order)."""
        pins = self._pins
        if pins:
            free = [k for k in keys if k not in pins]
            pins.difference_update(keys)
        else:
            free = keys
        if free:
            self.inner.unpin(free)

    def _flush(self) -> None:
        """Bring the heap up to date: push the dirty keys' nearest needs, drop stale entries
        once they outnumber the live ones (paid for by their pushes)."""
        heap, wants, held = self._heap, self._wants, self._held
        push = heapq.heappush
        for k in self._dirty:
            if k in held:
                seq, pos = wants[k][0]
                push(heap, (-seq, -pos, k))
        self._dirty.clear()
        if len(heap) > 64 and len(heap) > 4 * len(held):
            wants = self._wants
            self._heap = heap = [(-wants[k][0][0], -wants[k][0][1], k) for k in self._held]
            heapq.heapify(heap)

    # -- hints ---------------------------------------------------------------------------

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        if request_id in self._reqs:
            self.hint_dequeued(request_id)
        uniq = list(dict.fromkeys(keys))
        if not uniq:
            return
        seq = self._seq
        self._seq += 1
        self._reqs[request_id] = (seq, uniq)
        wants, held, marked, resident = self._wants, self._held, self._marked, self.inner
        dirty = self._dirty
        shield = []
        for pos, key in enumerate(uniq):
            d = wants.get(key)
            if d is not None:
                d.append((seq, pos))
                continue
            wants[key] = [(seq, pos)]
            if key in resident:  # not held (nobody wanted it): marked or ordinary
                if key in marked:
                    del marked[key]  # already shielded
                else:
                    shield.append(key)
                held.add(key)
                dirty.add(key)
        if shield:
            self._shield(shield)
        self._sync()

    def hint_dequeued(self, request_id: str) -> None:
        entry = self._reqs.pop(request_id, None)
        if entry is None:
            return
        seq, keys = entry
        wants, held, marks, marked = self._wants, self._held, self._marks, self._marked
        dirty = self._dirty
        back: list[OffloadKey] = []
        for pos, key in enumerate(keys):
            d = wants[key]
            if d[0][0] == seq:  # the nearest need was this request (the usual, FIFO case)
                del d[0]
                if d:
                    if key in held:
                        dirty.add(key)
                    continue
            else:
                d.remove((seq, pos))
                continue  # an earlier request still waits for it
            del wants[key]
            if key in held:
                held.discard(key)
                dirty.discard(key)
                if key in marks:
                    marked[key] = None
                else:
                    back.append(key)
        if back:
            self._release(back)
        self._trim_marked()
        self._sync()

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        marks, marked, wants, resident = self._marks, self._marked, self._wants, self.inner
        for key in keys:
            marks[key] = None
            marks.move_to_end(key)
            if key in marked:
                marked.move_to_end(key)
            elif key not in wants and key in resident:
                self._shield([key])
                marked[key] = None
        while len(marks) > self.capacity:
            old, _ = marks.popitem(last=False)
            if marked.pop(old, marked) is None:
                self._release([old])
        self._trim_marked()
        self._sync()

    def _trim_marked(self) -> None:
        marked = self._marked
        if len(marked) > self._max_marked:
            back = []
            while len(marked) > self._max_marked:
                back.append(marked.popitem(last=False)[0])
            self._release(back)

    # -- the policy interface ------------------------------------------------------------

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        """The inner policy's answer, except that a key a queued request needs is stored
        (and held at once, whatever the inner filter thinks of it) unless only held keys
        needed sooner could make room for it (``_bypass``)."""
        flags = self.inner.admit(keys, in_flight)
        wants = self._wants
        if not wants:
            return flags
        if flags is None:
            # The inner policy stores all (BIP may, beyond the room it has: its stores
            # are whole), so only the bypass can decline.
            if not self._held:
                return None
            out = self._bypass(keys, [True] * len(keys), in_flight)
            if all(out):
                return None
        else:
            out = [f or k in wants for k, f in zip(keys, flags)]
            if self._held:
                out = self._bypass(keys, out, in_flight)
        # Keys forced in for the queue may not fit: the store would be refused whole.
        return fit_room(out, len(keys), self.room(in_flight), self.capacity)

    def _bypass(self, keys: Sequence[OffloadKey], flags: list[bool], in_flight: int) -> list[bool]:
        """Belady's bypass against held keys: an admitted key that would push out a held
        key is stored only if a queued request needs it sooner than that key's nearest
        need (the j-th such key against the j-th farthest held key); the first one that is
        not declines the rest of the store, which a lookup could not reach past it.
        Cost O(k log h) for the k keys beyond the room that needs no held victim."""
        held = self._held
        free = self.room(in_flight) - (len(held) - len(held & self._pins))
        extra = sum(flags) - max(free, 0)
        if extra <= 0:
            return flags
        self._flush()
        heap, wants, pins = self._heap, self._wants, self._pins
        popped: list[tuple[int, int, OffloadKey]] = []
        victims: list[tuple[int, int]] = []
        seen: set[OffloadKey] = set()
        while len(victims) < extra and heap:
            entry = heapq.heappop(heap)
            neg_seq, neg_pos, key = entry
            if key not in held or key in seen or wants[key][0] != (-neg_seq, -neg_pos):
                continue  # stale (or a duplicate push of a live key)
            popped.append(entry)
            seen.add(key)
            if key not in pins:
                victims.append((-neg_seq, -neg_pos))
        for entry in popped:
            heapq.heappush(heap, entry)
        out = list(flags)
        skip = max(free, 0)  # admitted keys that fit without a held victim
        j = 0
        for i, (key, f) in enumerate(zip(keys, flags)):
            if not f:
                continue
            if skip:
                skip -= 1
                continue
            need = wants.get(key)
            if j >= len(victims) or need is None or need[0] >= victims[j]:
                for r in range(i, len(out)):
                    out[r] = False
                break
            j += 1
        return out

    # ``insert`` ... ``unpin`` below run only with hint state (see ``_sync``).

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.insert(keys)
        wants, marks = self._wants, self._marks
        if not wants and not marks:
            return
        shield = []
        for key in keys:
            if key in wants:
                self._held.add(key)
                self._dirty.add(key)
                shield.append(key)
            elif key in marks:
                self._marked[key] = None
                shield.append(key)
        if shield:
            self._shield(shield)
            self._trim_marked()

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.access(keys)  # held and marked keys too: they are in it, pinned
        marked = self._marked
        if marked:
            # A marked conversation read again: its mark has done its job.
            used = [k for k in keys if k in marked]
            if used:
                for k in used:
                    del marked[k]
                    self._marks.pop(k, None)
                self._release(used)
                self._sync()

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        held, marked = self._held, self._marked
        if not held and not marked:
            self.inner.pin(keys)
            return
        rest = [k for k in keys if k not in held and k not in marked]
        if len(rest) < len(keys):
            self._pins.update(k for k in keys if k in held or k in marked)
        if rest:
            self.inner.pin(rest)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        held, marked = self._held, self._marked
        if not held and not marked:
            self.inner.unpin(keys)
            return
        rest = [k for k in keys if k not in held and k not in marked]
        if len(rest) < len(keys):
            self._pins.difference_update(keys)
        if rest:
            self.inner.unpin(rest)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        inner = self.inner
        if not self._held and not self._marked:
            return inner.evict(n, incoming)  # nothing protected: n <= inner.num_evictable()
        take = min(n, inner.num_evictable())
        victims = inner.evict(take, incoming)
        if take < n:
            protected = self._evict_protected(n - take)
            discard = inner.discard  # type: ignore[attr-defined]
            for key in protected:
                discard(key)
            victims += protected
        return victims

    def _evict_protected(self, n: int) -> list[OffloadKey]:
        """``n`` victims among marked-out keys (oldest mark first), then held (farthest need)."""
        out: list[OffloadKey] = []
        pins, marked = self._pins, self._marked
        if marked:
            # Oldest first; pinned ones are passed over (few: a load pins only briefly).
            for key in marked:
                if len(out) == n:
                    break
                if key not in pins:
                    out.append(key)
            for key in out:
                del marked[key]
        self._flush()
        heap, held, wants = self._heap, self._held, self._wants
        skipped = []
        while len(out) < n:
            neg_seq, neg_pos, key = heapq.heappop(heap)
            if key not in held or wants[key][0] != (-neg_seq, -neg_pos):
                continue  # stale
            if key in pins:
                skipped.append((neg_seq, neg_pos, key))
                continue
            held.discard(key)
            out.append(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return out


class QueueArmsPolicy(QueueAwarePolicy):
    """Queue and session hints around ``policy_duel`` (chain-aware LRU's admission arms or ARC)."""

    name = "queue_arms"
    inner_cls = PolicyDuel
