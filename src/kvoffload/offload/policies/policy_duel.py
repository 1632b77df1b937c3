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
  lead of ``switch_margin`` shadow hits, back to ALL on any lead: keys ALL
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
from itertools import filterfalse, repeat, starmap
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.arc_arm import ArcArm
from kvoffload.offload.policies.arms import _OLDEST, ALL, ArmsChainLRUPolicy, _consume
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.chain_lru import ChainLRUPolicy
from kvoffload.offload.policies.shadow_tier import ARC, BIP, SECOND, ShadowTier

ARM_NAMES = ("all", "second", "bip", "arc")


def fit_room(flags: list[bool] | None, n: int, room: int, cap: int) -> list[bool] | None:
    """``flags`` (None: all of ``n`` keys) with admitted keys beyond the first ``room``
    declined: a store larger than the room the tier can make is refused whole, while
    its head part, which continues the stored prefix, is worth storing (a lookup reads
    a chain head first)."""
    if flags is None:
        if n <= room:
            return None
        flags = [True] * n
    elif sum(flags) <= room:
        return flags
    out = []
    # At most half the tier for an oversized store: replacing the whole tier by each
    # large request in turn is a loop's thrash (a round robin of prompts larger than
    # the tier then serves nothing).
    left = max(0, min(room, cap // 2))
    for f in flags:
        take = f and left > 0
        out.append(take)
        left -= take
    return out


class ArmsDuel(ArmsChainLRUPolicy):
    """``chain_arms`` whose duel also scores an ARC shadow; ``choice`` is the winning arm.

    ``mode`` (the LRU structure's admission) follows ``choice`` while that is an
    LRU arm, and keeps its last LRU arm while ARC leads. Not registered: it is
    ``PolicyDuel``'s LRU structure.
    """

    name = "arms_duel"
    min_shadow: ClassVar[int] = 32  # smaller shadows than chain_arms's: four of them run
    arc_margin: ClassVar[float] = 0.01  # ARC's shadow must lead the best LRU arm by this share
    all_margin: ClassVar[float] = 0.0  # what ALL must lead by (``switch_margin`` for the others)
    filter_margin: ClassVar[float] = 0.0  # ... plus this share of the current arm's score

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.rate = self.rate_mask + 1
        cap, hist = self.shadows[0].capacity, self.shadows[0].history
        self.tiers = [ShadowTier(cap, m, hist, self.bip_period) for m in (ALL, SECOND, BIP, ARC)]
        self.shadows = []  # chain_arms's per-key shadows: replaced by the tiers
        self.scores = [0.0, 0.0, 0.0, 0.0]
        # Start admitting everything, as plain LRU: a chat's next turn reads what this
        # turn stored, and a filter that starts on loses that (0.2-0.35 points), while
        # the shadows tie for the first thousand calls. What ALL lets in on first sight
        # and nobody reads again is ``_fresh``: when the duel moves to a filter, those
        # keys become rejects (else they would sit in the LRU, which a filter evicts only
        # after its rejects, and a late switch would cost more than never filtering).
        self.mode = self.choice = ALL
        self._fresh: set[OffloadKey] = set()
        # Request boundaries for the shadows' prefix scoring: a read (the hits a lookup
        # loads) starts a request, an offer (its misses, stored) continues the one before
        # it unless that one ended with an offer too.
        self._reading = False
        self._after_offer = True

    @property
    def arc_shadow(self) -> ArcArm:
        """The ARC arm's shadow structure (its ``p`` seeds the real one on a switch)."""
        return self.tiers[ARC].arc  # type: ignore[return-value]

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self._reading = True
        if self._fresh:
            self._fresh.difference_update(keys)
        super().access(keys)

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        self._reading = False
        if self.mode == ALL:
            self._note_fresh(keys)
        return super().admit(keys, in_flight)

    def _note_fresh(self, keys: Sequence[OffloadKey]) -> None:
        history, fresh = self.history, self._fresh
        fresh.update(filterfalse(history.__contains__, keys))
        if len(fresh) > 4 * self.capacity:
            # Offers that were never stored, or keys long evicted: O(n) once per n offers.
            nodes = self.inner
            self._fresh = {k for k in fresh if k in nodes}

    def _demote_fresh(self) -> None:
        """Leaving ALL for a filter: kept keys admitted on first sight and not read
        since become rejects, least recent first. O(capacity): once per such switch."""
        fresh = self._fresh
        if not fresh:
            return
        inner = self.inner
        moved = [k for k in inner.lru_order() if k in fresh]  # type: ignore[attr-defined]
        for k in moved:
            inner.discard(k)  # type: ignore[attr-defined]
        self.rejects.update(dict.fromkeys(moved))
        fresh.clear()

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        self._reading = False
        return super().evict(n, incoming)

    def observe_read(self, keys: Sequence[OffloadKey]) -> None:
        """Show the shadows a read the other structure served."""
        self._reading = True
        self._observe(keys)

    def observe_offer(self, keys: Sequence[OffloadKey]) -> None:
        """Show the shadows an offer the other structure takes."""
        self._reading = False
        self._observe(keys)

    def _observe(self, keys: Sequence[OffloadKey]) -> None:
        mask = self.rate_mask
        sample = [k for k in keys if (k[-5] & mask) == 0] if mask else keys
        reading = self._reading
        new_request = reading or self._after_offer
        self._after_offer = not reading
        a, b, c, d = self.tiers
        if new_request:
            a.broken = b.broken = c.broken = d.broken = False
        if not sample:
            return
        self._calls += 1
        decay = self._keep ** len(sample)
        sa, sb, sc, sd = self.scores
        sa = sa * decay + a.run(sample)
        sb = sb * decay + b.run(sample)
        sc = sc * decay + c.run(sample)
        sd = sd * decay + d.run(sample)
        self.scores = [sa, sb, sc, sd]
        # As in chain_arms: BIP's shadow flatters it, second sighting must lead a little.
        eff = (sa, sb / self.second_lead, sc / self.bip_lead)
        mode = self.mode
        # The first of the best, as max(range(3), key=eff.__getitem__) (ties keep the lower).
        best, top = 0, eff[0]
        if eff[1] > top:
            best, top = 1, eff[1]
        if eff[2] > top:
            best = 2
        # Leaving a filter for ALL is cheap (nothing kept is lost) and waiting costs a
        # chat its next turns' hits, so ALL needs only to lead; a filter, which keeps
        # whatever ALL let in and is slow to undo, needs the margin.
        if best == ALL:
            margin = self.all_margin
        else:
            margin = self.switch_margin + self.filter_margin * eff[mode]
        if best != mode and eff[best] > eff[mode] + margin:
            if mode == ALL:
                self._demote_fresh()
            self.mode = mode = best
        lead = eff[mode]
        if self.choice == ARC:
            # Leave ARC only once the LRU arm leads it by the same margin.
            if lead > sd * (1.0 + self.arc_margin) + self.switch_margin:
                self.choice = mode
            return
        if sd > lead * (1.0 + self.arc_margin) + self.switch_margin:
            self.choice = ARC
        else:
            self.choice = mode

    def note_offer(self, keys: Sequence[OffloadKey]) -> None:
        """Record an offer in the sighting history (as ``admit`` does), deciding nothing:
        the ARC structure is live, and a later switch back needs the history current."""
        history = self.history
        for k in keys:
            history[k] = None
        _consume(map(history.move_to_end, keys))  # each key most recent, in call order
        over = len(history) - self._history_size
        if over > 0:
            _consume(starmap(history.popitem, repeat(_OLDEST, over)))

    def take_resident(self) -> tuple[list[OffloadKey], list[OffloadKey], list[OffloadKey]]:
        """(rejects, kept keys, pinned keys), unpinned ones next victim first; then empty.

        O(capacity): only for a switch to the other structure."""
        rejects = list(self.rejects)
        kept = self.inner.lru_order()  # type: ignore[attr-defined]
        pinned = self.inner.pinned_keys() + list(self._pinned_rejects)  # type: ignore[attr-defined]
        self._reset_resident()
        return rejects, kept, pinned

    def give_resident(
        self,
        once: list[OffloadKey],
        again: list[OffloadKey],
        pinned: list[OffloadKey],
        pending: Sequence[OffloadKey],
    ) -> None:
        """Hold ``once`` and ``again`` (unpinned, least recent first) and ``pinned``.

        Admitting all, ``once`` is the LRU's least recent part; otherwise it is the
        reject FIFO (keys seen once are what the filters keep out). ``pending``: keys
        of a store already made room for, admitted when they arrive."""
        self._reset_resident()
        inner = self.inner
        if self.mode == ALL:
            kept = once + again
            self._fresh.update(once)  # ARC's T1: seen once, as ALL's first sightings
        else:
            kept = again
            self.rejects.update(dict.fromkeys(once))
        if pinned:
            inner.insert(pinned)
            inner.pin(pinned)
        if kept:
            inner.insert(kept[::-1])  # insert puts its first key most recent
        self._admit.update(pending)

    def _reset_resident(self) -> None:
        self.inner = ChainLRUPolicy(self.capacity)
        self.rejects.clear()
        self._pinned_rejects.clear()
        self._admit.clear()
        self._offered = None
        self._fresh.clear()


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
        if not self.on_arc:
            flags = self.lru.admit(keys, in_flight)
            if self.lru.mode == BIP:
                return flags  # BIP keeps what it holds: an oversized store stays refused
        else:
            self.lru.observe_offer(keys)
            self.lru.note_offer(keys)
            self._decided = set(keys)
            flags = None  # ARC stores every key (T1 is its filter)
        return fit_room(flags, len(keys), self.room(in_flight), self.capacity)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        (self.arc if self.on_arc else self.lru).insert(keys)

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
