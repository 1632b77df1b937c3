"""A duel among whole policies: chain-aware LRU with three admission modes, or ARC.

``chain_arms`` chooses an admission mode (all, second sighting, BIP) in front
of chain-aware LRU by sampled shadow caches. Where a small set of blocks is
read again and again among many read once or twice (shared RAG documents
beside unique questions, a chat's system prompts beside its turns), ARC keeps
the frequent ones better than any admission filter can (its T2 is protected
from a scan of new keys, and its ghost lists adapt the split): kvoffload's
``arc`` leads ``chain_arms`` there by up to 5 points at 1%. Where nearly
every block is read once more soon (agents, a chat's next turn at a larger
tier), LRU leads. So a fourth shadow replays the same sample under ARC,
all four as small tiers that take each call as the real one does
(``shadow_tier``: prefix hits, room made per store; a key-by-key shadow
misjudged ARC by 14 points on an agent trace), and the real cache follows
the best of the four arms:

- the three LRU arms share one structure (``chain_arms``'s), switching
  between them is a mode flag;
- the ARC arm is a second structure (``arc_arm``): switching moves the
  resident keys over, O(capacity) once, and keeps the manager's pins
  (LRU -> ARC: rejects become T1, the LRU's keys T2, least recent first;
  ARC -> LRU: T1 becomes the rejects (or, admitting all, the LRU's least
  recent part), T2 the rest). A switch is allowed only after ``capacity``
  keys have been offered or read since the last one (so its cost is O(1)
  amortised per key) and when ARC's shadow leads by ``arc_margin``
  (relative, in decayed shadow hits), so noise does not move the keys back
  and forth;
- it starts admitting all (plain chain LRU), and moves to a filter only on a
  lead of ``switch_margin`` shadow hits, or when the real tier's first
  sightings are evicted unread (``ArmsDuel._fates``), back to ALL on any lead
  (on ``switch_margin`` after such a verdict): keys ALL
  let in on first sight and never read again are demoted to rejects when a
  filter takes over (else the filter, which evicts its rejects first, would
  keep them for good);
- ``admit`` declines the tail of a store larger than the room the tier can
  make (at most half the tier), except under BIP: the manager would refuse
  the store whole, and its head continues the stored prefix.

The shadows keep seeing every call whichever structure is live, so the
duel keeps scoring all arms. Everything is decided by key bytes and call
order. Invariant: exactly one structure holds resident keys (the other is
empty); ``len``, ``num_evictable`` and pins are the live structure's.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.default.arc_arm import ArcArm
from kvoffload.offload.policies.default.arms_duel import ArmsDuel
from kvoffload.offload.policies.default.shadow_tier import ARC, BIP

__all__ = ["ARC", "ARM_NAMES", "ArmsDuel", "PolicyDuel", "fit_room"]

ARM_NAMES = ("all", "second", "bip", "arc")


def fit_room(flags: list[bool] | None, n: int, room: int, cap: int) -> list[bool] | None:
    """``flags`` (None: all of ``n`` keys) with admitted keys beyond the first ``room``
    declined: a store larger than the room the tier can make is refused whole, while
    its head part, which continues the stored prefix, is worth storing (a lookup reads
    a chain head first)."""
    # At most half the tier for an oversized store: replacing the whole tier by each
    # large request in turn is a loop's thrash (a round robin of prompts larger than
    # the tier then serves nothing).
    left = max(0, min(room, cap // 2))
    if flags is None:
        if n <= room:
            return None
        take = min(left, n)
        return [True] * take + [False] * (n - take)
    if sum(flags) <= room:
        return flags
    # The first ``left`` admitted keys keep their flag, every key after them is declined.
    admitted = list(compress(range(len(flags)), flags))
    cut = admitted[left] if left < len(admitted) else len(flags)
    return flags[:cut] + [False] * (len(flags) - cut)


class PolicyDuel(CachePolicy):
    """The live one of two structures (``ArmsDuel``'s LRU, ``ArcArm``), chosen by a 4-arm duel."""

    name = "policy_duel"
    dwell: ClassVar[int] = 1  # capacities of keys between two switches of structure

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.lru = ArmsDuel(capacity)
        self.arc = ArcArm(capacity)
        self.on_arc = False
        self._clock = 0  # keys offered or read
        self._last_switch = 0
        self._decided: set[OffloadKey] | None = None  # keys ``admit`` observed (ARC live)
        # What the tier holds when full, smoothed (``ArmsDuel.fit_shadows``): measured after
        # each store that had to evict.
        self._full = False
        self._resident = float(capacity)
        self._units = False  # ``hint_units``: the LRU structure's capacity follows it too

    def hint_units(self) -> None:
        """Under chunk units the LRU structure is sized by what the tier holds when full
        (``ArmsDuel.fit_tier``), and its duel gates switches by their noise."""
        self._units = True
        self.lru.hint_units()

    # -- introspection -----------------------------------------------------------------

    @property
    def live(self) -> CachePolicy:
        return self.arc if self.on_arc else self.lru

    @property
    def arm(self) -> str:
        """The arm the real cache follows now (for reports and tests)."""
        return "arc" if self.on_arc else ARM_NAMES[self.lru.mode]

    def __len__(self) -> int:
        return len(self.arc) if self.on_arc else len(self.lru)

    def __contains__(self, key: object) -> bool:
        return key in (self.arc if self.on_arc else self.lru)

    def num_evictable(self) -> int:
        return self.arc.num_evictable() if self.on_arc else self.lru.num_evictable()

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        if not self.on_arc:
            self.lru.hint_parent(child, parent)

    # -- the policy interface ------------------------------------------------------------

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        self._clock += len(keys)
        lru = self.lru
        if not self.on_arc:
            flags = lru.admit(keys, in_flight)
            if lru.mode == BIP:
                return flags  # BIP keeps what it holds: an oversized store stays refused
            room = lru.room(in_flight)
        else:
            lru.observe_offer(keys)
            lru.note_offer(keys)
            self._decided = set(keys)
            flags = None  # ARC stores every key (T1 is its filter)
            room = self.arc.room(in_flight)
        # Under chunk units the tier holds ``lru.capacity`` chunks when full (``fit_tier``),
        # fewer than its slots: half the tier for an oversized store is counted in chunks.
        return fit_room(flags, len(keys), room, self.lru.capacity if self._units else self.capacity)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        (self.arc if self.on_arc else self.lru).insert(keys)
        if self._full:
            self._full = False
            resident = self._resident
            resident += (len(self) - resident) / 8
            self._resident = resident
            size = int(resident)
            if 16 * abs(size - self.arc.capacity) > self.arc.capacity:
                self.arc.retarget(size)
            if self._units:
                self.lru.fit_tier(size)
            else:
                self.lru.fit_shadows(size)

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self._clock += len(keys)
        if self.on_arc:
            self.lru.observe_read(keys)
            self.arc.access(keys)
        else:
            self.lru.access(keys)

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        (self.arc if self.on_arc else self.lru).pin(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        (self.arc if self.on_arc else self.lru).unpin(keys)

    def is_pinned(self, key: OffloadKey) -> bool:
        """Whether resident ``key`` is pinned, as the queue wrapper needs."""
        return (self.arc if self.on_arc else self.lru).is_pinned(key)

    def discard(self, key: OffloadKey) -> None:
        """Forget resident ``key`` (pinned or not), as the queue wrapper needs."""
        (self.arc if self.on_arc else self.lru).discard(key)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        if n:
            self._full = True
        if self.on_arc:
            decided, self._decided = self._decided, None
            if decided is None or not decided.issuperset(incoming):
                self._clock += len(incoming)
                self.lru.observe_offer(incoming)
                self.lru.note_offer(incoming)
            victims = self.arc.evict(n, incoming)
        else:
            if self.lru._offered is None:
                self._clock += len(incoming)
            victims = self.lru.evict(n, incoming)
        if (self.lru.choice == ARC) != self.on_arc:
            self._maybe_switch(incoming)
        return victims

    # -- switching structures -----------------------------------------------------------

    def _maybe_switch(self, pending: Sequence[OffloadKey]) -> None:
        """Follow the duel to the other structure, at most once per ``capacity`` keys.

        Called at the end of a store's ``evict``: ``pending`` (that store's keys)
        arrive in the structure live after it."""
        want_arc = self.lru.choice == ARC
        if want_arc == self.on_arc or self._clock - self._last_switch < self.dwell * self.capacity:
            return
        self._last_switch = self._clock
        if want_arc:
            rejects, kept, pinned = self.lru.take_resident()
            self.arc.load(rejects, kept, pinned, self.lru.arc_shadow.p * self.lru.rate)
            self.on_arc = True
        else:
            once, again = self.arc.export()
            pinned = list(self.arc.pinned)
            self.arc.load((), (), (), 0.0)
            self.lru.give_resident(once, again, pinned, pending)
            self.on_arc = False
