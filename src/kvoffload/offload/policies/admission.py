"""Admission on second sighting, in front of any eviction policy.

Most offloaded blocks are never read again. vLLM's ``store_threshold=2``
stores a block only when it is offered a second time; a tier here cannot
refuse a store (``prepare_store`` gives every new key a slot), so this wrapper
admits *late* instead: a key never seen before is stored into a *reject*
FIFO whose keys are evicted before anything the inner policy holds, so it
keeps its slot only until the next stores need room. A key that a bounded
history remembers (seen in an earlier store) goes to the inner policy. A
reject read again (accessed or pinned by a load) is promoted into the inner
policy: its reuse proved it.

The history is a FIFO of keys (no counts) of ``history_factor`` x capacity
keys, at least ``min_history``; vLLM's tracker keeps 64,000.

Invariants: resident keys = inner's keys + rejects (disjoint); the rejects
are unpinned (a pin promotes); every operation is O(1) amortised per key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.arc import ARCPolicy
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.lru import LRUPolicy


class Sightings:
    """How many times each of the ``max_keys`` most recently sighted keys was sighted.

    The counter behind "store a block only on its n-th offer" (vLLM's
    ``store_threshold``; n = 2 is second sighting): ``sight(key)`` counts one
    sighting and returns the count; a key pushed out (least recently sighted
    first) counts from zero again, so memory stays bounded whatever the keys.
    """

    __slots__ = ("_counts", "max_keys")

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def sight(self, key: OffloadKey) -> int:
        counts = self._counts
        n = counts.pop(key, 0) + 1
        counts[key] = n
        if len(counts) > self.max_keys:
            counts.popitem(last=False)
        return n

    def clear(self) -> None:
        self._counts.clear()


class SecondSightPolicy(CachePolicy):
    """Second-sighting admission in front of ``inner_cls`` (set by subclasses)."""

    inner_cls: ClassVar[type[CachePolicy]]
    history_factor: ClassVar[int] = 4
    min_history: ClassVar[int] = 64_000
    adaptive_share: ClassVar[bool] = True  # ARC-style target share of the rejects

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.inner = self.inner_cls(capacity)
        self.rejects: OrderedDict[OffloadKey, None] = OrderedDict()  # oldest first
        self.history: OrderedDict[OffloadKey, None] = OrderedDict()
        self._history_size = max(self.min_history, self.history_factor * capacity)
        self._admit: set[OffloadKey] = set()  # incoming keys judged worth keeping
        # Adaptive share of the rejects (ARC's p between the rejects and the inner policy).
        self.target: float = 0.0
        self.ghost_rejects: OrderedDict[OffloadKey, None] = OrderedDict()
        self.ghost_inner: OrderedDict[OffloadKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.inner) + len(self.rejects)

    def __contains__(self, key: object) -> bool:
        return key in self.rejects or key in self.inner

    def num_evictable(self) -> int:
        return self.inner.num_evictable() + len(self.rejects)

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        self.inner.hint_parent(child, parent)

    def _promote(self, keys: Sequence[OffloadKey]) -> None:
        """Move the rejects among ``keys`` into the inner policy."""
        rejects = self.rejects
        if rejects:
            # A key may repeat within one call (touch([k, k])): pop() takes it once.
            promoted = [k for k in keys if rejects.pop(k, rejects) is None]
            if promoted:
                self.inner.insert(promoted)

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self._promote(keys)
        self.inner.access(keys)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        self._promote(keys)
        self.inner.pin(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.unpin(keys)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        admit = self._admit
        kept = [k for k in keys if k in admit]
        if kept:
            admit.difference_update(kept)
            self.inner.insert(kept)
        if len(kept) < len(keys):
            rejects = self.rejects
            for k in self.chain_order(keys):
                if k not in self.inner:
                    rejects[k] = None

    def discard(self, key: OffloadKey) -> None:
        """Forget resident ``key`` (pinned or not); the inner policy must have ``discard``."""
        if self.rejects.pop(key, self.rejects) is not None:
            self.inner.discard(key)  # type: ignore[attr-defined]

    def admit_all(self) -> bool:
        """Whether every new key goes straight to the inner policy (subclasses decide)."""
        return False

    def _adapt(self, key: OffloadKey) -> None:
        gr, gi = self.ghost_rejects, self.ghost_inner
        if key in gr:
            del gr[key]
            self.target = min(float(self.capacity), self.target + max(1.0, len(gi) / (len(gr) + 1)))
        elif key in gi:
            del gi[key]
            self.target = max(0.0, self.target - max(1.0, len(gr) / (len(gi) + 1)))

    @staticmethod
    def _ghost(ghost: OrderedDict[OffloadKey, None], keys: Sequence[OffloadKey], cap: int) -> None:
        for k in keys:
            ghost[k] = None
        while len(ghost) > cap:
            ghost.popitem(last=False)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        history, admit = self.history, self._admit
        admitted = []
        everyone = self.admit_all()
        for k in incoming:
            if self.adaptive_share:
                self._adapt(k)
            if k in history:
                history.move_to_end(k)
            elif not everyone:
                history[k] = None
                continue
            else:
                history[k] = None
            admitted.append(k)
            admit.add(k)
        while len(history) > self._history_size:
            history.popitem(last=False)
        if len(admit) > self._history_size:
            admit.clear()  # stores that never completed; forgetting them only delays admission
        if n == 0:
            self.inner.evict(0, admitted)
            return []
        rejects, inner = self.rejects, self.inner
        # Rejects beyond their target share go first; then the inner policy's victims.
        r = min(n, max(0, len(rejects) - int(self.target)))
        r = max(r, n - inner.num_evictable())
        victims = [rejects.popitem(last=False)[0] for _ in range(r)]
        rest = inner.evict(n - r, admitted)
        if self.adaptive_share:
            self._ghost(self.ghost_rejects, victims, self.capacity)
            self._ghost(self.ghost_inner, rest, self.capacity)
        return victims + rest


class AdmitARCPolicy(SecondSightPolicy):
    """ARC behind second-sighting admission."""

    name = "arc_admit"
    inner_cls = ARCPolicy


class AdmitLRUPolicy(SecondSightPolicy):
    """LRU behind second-sighting admission."""

    name = "lru_admit"
    inner_cls = LRUPolicy
