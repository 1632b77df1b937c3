"""Queue-aware eviction: blocks that waiting requests need are kept, nearest need first.

A loaded server holds requests that have arrived but not run, and it has
already hashed their prompts. The manager forwards that queue as hints
(``hint_queued(request_id, keys)`` on arrival, ``hint_dequeued`` once the
request is scheduled, aborted or finished). This wrapper acts on them around
an inner policy that orders everything else:

- a resident key that some queued request needs is *held*: taken out of the
  inner policy, so the inner policy's victims (whose next use, if any, lies
  beyond the known queue) always go first, as Belady's rule says;
- when only held keys are left to evict, the one needed farthest ahead goes
  (the largest queue position of its nearest waiting request; within one
  request, the chain's tail before its head, since a lookup stops at the
  first missing block);
- admission follows the queue: a new key a queued request needs is held at
  once, past the inner policy's admission filter; an unneeded one goes to the
  inner policy, which evicts it first while the tier is full of needed keys;
- when a request leaves the queue its keys that nobody else waits for go back
  to the inner policy as just used (the request read them);
- ``hint_continues(keys)`` (a client says the conversation goes on) marks
  keys; a marked resident key is kept out of the inner policy too, but is
  evicted before any held key, oldest mark first, and at most half the tier
  is kept that way (a soft priority, not a reservation).

Costs: each hint is O(keys of the request) amortised (a heap entry per held
key whose nearest need changes, stale entries dropped lazily and compacted
against the pushes); without hints every operation is the inner policy's plus
a constant. Nothing scans the resident keys. Invariants: resident keys =
inner's + held + marked-out (disjoint); a held key has a waiting request;
``num_evictable`` = inner's + held and marked-out keys not pinned.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.arms import ArmsChainLRUPolicy
from kvoffload.offload.policies.base import CachePolicy


class QueueAwarePolicy(CachePolicy):
    """Queue and session hints around ``inner_cls`` (set by subclasses), which must have
    ``discard(key)``: forget a resident key, pinned or not, without evicting it."""

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
        self._marks: OrderedDict[OffloadKey, None] = OrderedDict()  # continue marks, oldest first
        self._marked: OrderedDict[OffloadKey, None] = OrderedDict()  # resident, marked, outside
        self._pins: set[OffloadKey] = set()  # manager pins of every resident key
        self._resident: set[OffloadKey] = set()  # every resident key (cheaper than asking inner)
        self._out_pinned = 0  # pinned keys among held + marked-out
        self._max_marked = int(self.continue_share * capacity)
        # Where the inner policy learns from reads (shadow caches), it sees the held keys' too.
        self._observe = getattr(self.inner, "observe", None)

    # -- introspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.inner) + len(self._held) + len(self._marked)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def num_evictable(self) -> int:
        return self.inner.num_evictable() + len(self._held) + len(self._marked) - self._out_pinned

    def is_held(self, key: OffloadKey) -> bool:
        """Whether ``key`` is resident and protected for a waiting request."""
        return key in self._held

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        self.inner.hint_parent(child, parent)

    # -- moving keys between the inner policy and the protected sets ----------------------

    def _take_out(self, key: OffloadKey) -> None:
        """Resident ``key`` of the inner policy leaves it (it is about to be held or marked)."""
        self.inner.discard(key)  # type: ignore[attr-defined]
        if key in self._pins:
            self._out_pinned += 1

    def _put_back(self, keys: list[OffloadKey]) -> None:
        """Resident keys outside the inner policy return to it as just used (chain order)."""
        inner, pins = self.inner, self._pins
        inner.insert(keys)
        pinned = [k for k in keys if k in pins]
        if pinned:
            self._out_pinned -= len(pinned)
            inner.pin(pinned)
        # Their reads were shown to the inner policy's shadows when they happened.
        getattr(inner, "access_unobserved", inner.access)(keys)

    def _push(self, key: OffloadKey) -> None:
        seq, pos = self._wants[key][0]
        heapq.heappush(self._heap, (-seq, -pos, key))

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones (paid by their pushes)."""
        heap = self._heap
        if len(heap) > 64 and len(heap) > 4 * len(self._held):
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
        wants, held, marked, resident = self._wants, self._held, self._marked, self._resident
        heap, push = self._heap, heapq.heappush
        for pos, key in enumerate(uniq):
            d = wants.get(key)
            if d is not None:
                d.append((seq, pos))
                continue
            wants[key] = [(seq, pos)]
            if key in resident:  # not held (nobody wanted it): marked-out or in the inner policy
                if key in marked:
                    del marked[key]
                else:
                    self._take_out(key)
                held.add(key)
                push(heap, (-seq, -pos, key))
        self._compact()

    def hint_dequeued(self, request_id: str) -> None:
        entry = self._reqs.pop(request_id, None)
        if entry is None:
            return
        seq, keys = entry
        wants, held, marks, marked = self._wants, self._held, self._marks, self._marked
        heap, push = self._heap, heapq.heappush
        back: list[OffloadKey] = []
        for pos, key in enumerate(keys):
            d = wants[key]
            if d[0][0] == seq:  # the nearest need was this request (the usual, FIFO case)
                del d[0]
                if d:
                    if key in held:
                        nseq, npos = d[0]
                        push(heap, (-nseq, -npos, key))
                    continue
            else:
                d.remove((seq, pos))
                continue  # an earlier request still waits for it
            del wants[key]
            if key in held:
                held.discard(key)
                if key in marks:
                    marked[key] = None
                else:
                    back.append(key)
        if back:
            self._put_back(back)
        self._trim_marked()
        self._compact()

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        marks, marked, wants = self._marks, self._marked, self._wants
        for key in keys:
            marks[key] = None
            marks.move_to_end(key)
            if key in marked:
                marked.move_to_end(key)
            elif key not in wants and key in self._resident:
                self._take_out(key)
                marked[key] = None
        while len(marks) > self.capacity:
            old, _ = marks.popitem(last=False)
            if marked.pop(old, marked) is None:
                self._put_back([old])
        self._trim_marked()

    def _trim_marked(self) -> None:
        marked = self._marked
        if len(marked) > self._max_marked:
            back = []
            while len(marked) > self._max_marked:
                back.append(marked.popitem(last=False)[0])
            self._put_back(back)

    # -- the policy interface ------------------------------------------------------------

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self._resident.update(keys)
        wants, marks = self._wants, self._marks
        if not wants and not marks:
            self.inner.insert(keys)
            return
        rest = []
        for key in keys:
            if key in wants:
                self._held.add(key)
                self._push(key)
            elif key in marks:
                self._marked[key] = None
            else:
                rest.append(key)
        if rest:
            self.inner.insert(rest)
        self._trim_marked()

    def access(self, keys: Sequence[OffloadKey]) -> None:
        held, marked = self._held, self._marked
        if not held and not marked:
            self.inner.access(keys)
            return
        rest = [k for k in keys if k not in held and k not in marked]
        if self._observe is not None and len(rest) < len(keys):
            self._observe([k for k in keys if k in held or k in marked])
        if marked:
            # A marked conversation read again: its mark has done its job.
            used = [k for k in keys if k in marked]
            for k in used:
                del marked[k]
                self._marks.pop(k, None)
            if used:
                self._put_back(used)
        if rest:
            self.inner.access(rest)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        pins, held, marked = self._pins, self._held, self._marked
        pins.update(keys)
        if not held and not marked:
            self.inner.pin(keys)
            return
        rest = []
        for k in keys:
            if k in held or k in marked:
                self._out_pinned += 1
            else:
                rest.append(k)
        if rest:
            self.inner.pin(rest)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        pins, held, marked = self._pins, self._held, self._marked
        pins.difference_update(keys)
        if not held and not marked:
            self.inner.unpin(keys)
            return
        rest = []
        for k in keys:
            if k in held or k in marked:
                self._out_pinned -= 1
            else:
                rest.append(k)
        if rest:
            self.inner.unpin(rest)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        wants, marks = self._wants, self._marks
        if wants or marks:
            # Only keys bound for the inner policy are its admission's business; the
            # others are still reads (misses) for its shadows to see.
            if self._observe is not None:
                self._observe([k for k in incoming if k in wants or k in marks])
            incoming = [k for k in incoming if k not in wants and k not in marks]
        inner = self.inner
        take = min(n, inner.num_evictable())
        victims = inner.evict(take, incoming)
        if take < n:
            victims += self._evict_protected(n - take)
        self._resident.difference_update(victims)
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
    """Queue and session hints around ``chain_arms``."""

    name = "queue_arms"
    inner_cls = ArmsChainLRUPolicy
