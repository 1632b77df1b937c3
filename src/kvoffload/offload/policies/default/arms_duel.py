"""``PolicyDuel``'s LRU structure: chain-aware LRU's three admission arms, scored beside ARC.

``ArmsDuel`` is ``chain_arms`` (``arms``) whose shadows are four call-by-call
shadow tiers (``shadow_tier``: all, second sighting, BIP and ARC) and whose
``choice`` names the winning arm, so that ``PolicyDuel`` can move its keys to
an ARC structure while ARC's shadow leads. Besides the shadows, it watches
the real tier's first sightings while admitting all: when nearly none of
them is read again before its eviction (``_fates``), second sighting takes
over unless ALL's shadow clearly leads. Its hot methods (``access``,
``admit``, ``evict``, the sizes) inline the layers of ``ArmsChainLRUPolicy``
and ``SecondSightPolicy`` they replace: every state change is theirs, in the
same order (pinned by ``tests/offload/test_policy_duel.py``'s decision
digests). Invariants: ``ArmsChainLRUPolicy``'s; ``inner`` is always a
``ChainLRUPolicy``; ``mode`` is an LRU arm, ``choice`` any of the four.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import filterfalse, repeat, starmap
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.default.arc_arm import ArcArm
from kvoffload.offload.policies.default.arms import (
    _OLDEST,
    ALL,
    ArmsChainLRUPolicy,
    _consume,
    sampled,
)
from kvoffload.offload.policies.default.chain_lru import ChainLRUPolicy
from kvoffload.offload.policies.default.shadow_tier import ARC, BIP, SECOND, ShadowTier

#: The six pairs of arms (``ArmsDuel._spread``) and each pair's index, either way round.
_PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
_PAIR = [[0] * 4 for _ in range(4)]
for _p, (_i, _j) in enumerate(_PAIRS):
    _PAIR[_i][_j] = _PAIR[_j][_i] = _p


def _no_noise(arm: int, mode: int) -> float:
    """``ArmsDuel._noise`` of a plain tier: margins as they are."""
    return 0.0


class ArmsDuel(ArmsChainLRUPolicy):
    """``chain_arms`` whose duel also scores an ARC shadow; ``choice`` is the winning arm.

    ``mode`` (the LRU structure's admission) follows ``choice`` while that is an
    LRU arm, and keeps its last LRU arm while ARC leads. Not registered: it is
    ``PolicyDuel``'s LRU structure.
    """

    name = "arms_duel"
    inner: ChainLRUPolicy  # (``inner_cls``: the hot path reads its node map and count)
    min_shadow: ClassVar[int] = 32  # smaller shadows than chain_arms's: four of them run
    arc_margin: ClassVar[float] = 0.01  # ARC's shadow must lead the best LRU arm by this share
    all_margin: ClassVar[float] = 0.5  # what ALL must lead by (``switch_margin`` for the others)
    filter_margin: ClassVar[float] = 0.0  # ... plus this share of the current arm's score
    fresh_trial: ClassVar[int] = 1024  # first sightings' fates (read or evicted) per verdict
    fresh_share: ClassVar[float] = 0.05  # ... of which at most this share read: a verdict
    # Under chunk units only (``hint_units``): a switch needs a lead beyond this many
    # standard deviations of the two arms' score difference (``_spread``); between ALL
    # and a filter, times twice the share of ALL's first sightings read (at most 1).
    noise_z: ClassVar[float] = 2.0
    leave_all_weight: ClassVar[float] = 2.0

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
        # The real tier's fates of ALL's first sightings (``_fresh``): read again, or
        # evicted unread. Unsampled, so they speak long before shadows that see 1 key in
        # 8 or 16 tell ALL from second sighting (on a real arxiv-trace slice the shadows
        # took 790 requests; ALL's cost there was 0.1-0.5 points below store_threshold=2).
        self._useful = 0
        self._wasted = 0
        self._first_wasted = False  # the verdict: first sightings are not read again
        # Request boundaries for the shadows' prefix scoring: a read (the hits a lookup
        # loads) starts a request, an offer (its misses, stored) continues the one before
        # it unless that one ended with an offer too.
        self._reading = False
        self._after_offer = True
        # The sampled keys this request read: an offer continuing the request is stored
        # behind them in the LRU arms' shadows, as the chain list anchors it (``_behind_prefix``).
        self._prefix: Sequence[OffloadKey] = ()
        self._units = False  # ``hint_units``: this structure ranks chunk units
        # Under chunk units: per pair of arms (``_PAIR``), the decayed sum of squared
        # per-call differences of their shadow hits (the variance of their score gap).
        self._var = [0.0] * 6

    def fit_shadows(self, resident: int) -> None:
        """The real tier holds ``resident`` keys of this policy when full: the shadows model
        a tier of that size (1 in ``rate``), resized once it moves by more than 1/16.

        A plain tier holds ``capacity`` (nothing changes). Under ``chunk_units`` this
        policy ranks chunks, each holding one to one-per-group slots, so the tier holds
        fewer of them than its capacity: shadows sized by the capacity judged a tier up
        to 1.7 times too large (4 groups, window 1,024, 5%), where ARC and second
        sighting looked as good as admitting all, and lost 5 points to plain LRU."""
        cap = max(1, resident // self.rate)
        now = self.tiers[0].capacity
        if 16 * abs(cap - now) <= now:
            return
        for tier in self.tiers:
            tier.resize(cap)
        self._keep = 1.0 - 1.0 / (self.window * cap)

    def hint_units(self) -> None:
        self._units = True

    def fit_tier(self, resident: int) -> None:
        """Under chunk units (``hint_units``): ``fit_shadows``, and this structure's own
        capacity follows what the tier holds when full, once it moves by more than 1/16.

        Counted in slots, ``admit`` saw free room in a full tier (a 2-group tier holds
        about 0.9 chunks per slot, a 4-group one 0.6): second sighting stored the first
        sightings it declined at the expense of kept chunks, so the real filter did worse
        than its shadow (2 groups, window 128, 10%, second sighting throughout: 50.45
        hit %, 51.43 sized by chunks; admitting all: 51.66). Plain tiers never get here:
        a full tier of one group holds ``capacity`` keys, save for stores in flight,
        which must not shrink it."""
        if 16 * abs(resident - self.capacity) > self.capacity:
            self.capacity = resident
        self.fit_shadows(resident)

    @property
    def arc_shadow(self) -> ArcArm:
        """The ARC arm's shadow structure (its ``p`` seeds the real one on a switch)."""
        return self.tiers[ARC].arc  # type: ignore[return-value]

    # -- the hot path ---------------------------------------------------------------------
    # ``access``, ``admit``, ``evict`` and the sizes are ``ArmsChainLRUPolicy``'s (and its
    # ``SecondSightPolicy``'s) with the layers between a manager call and the chain list
    # inlined: the same state changes in the same order, fewer call frames per call.

    def __len__(self) -> int:
        return len(self.inner._nodes) + len(self.rejects) + len(self._pinned_rejects)

    def num_evictable(self) -> int:
        return self.inner._linked + len(self.rejects)

    def room(self, in_flight: int = 0) -> int:
        inner = self.inner
        # capacity - len(self) - in_flight + num_evictable(), the rejects cancelling out.
        held = len(inner._nodes) + len(self._pinned_rejects) - inner._linked
        return self.capacity - held - in_flight

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self._reading = True
        if self._fresh:
            self._leave_fresh(keys, True)
        self.observe_read(keys)
        rejects = self.rejects
        if not self._pinned_rejects and (not rejects or rejects.keys().isdisjoint(keys)):
            self.inner.access(keys)  # (``access_unobserved``'s usual case)
        else:
            self.access_unobserved(keys)

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        self._reading = False
        if self.mode == ALL:
            self._note_fresh(keys)
        self._offered = None
        if not keys:
            return None
        self.observe_offer(keys)
        return self._decide(keys, in_flight)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        self._reading = False
        victims = super().evict(n, incoming)
        if victims and self._fresh:
            self._leave_fresh(victims, False)
        return victims

    def _leave_fresh(self, keys: Sequence[OffloadKey], read: bool) -> None:
        """``keys`` were read (``read``) or evicted: those of them still fresh leave
        ``_fresh``, counted as that fate."""
        fresh = self._fresh
        before = len(fresh)
        fresh.difference_update(keys)
        left = before - len(fresh)
        if left and read:
            self._fates(left, 0)
        elif left:
            self._fates(0, left)

    def _fates(self, useful: int, wasted: int) -> None:
        """Count keys admitted on first sight that were read again (``useful``) or
        evicted unread (``wasted``). From ``fresh_trial`` counted fates on, the verdict
        is whether at most ``fresh_share`` of them were reads; past twice that, both
        counts halve, so older fates weigh less.

        The window is long because evictions come in runs: with 128 fates one large
        store's run of unread victims decided, and conversation traces at 25% tiers,
        where half of the first sightings are read at the next turn, lost up to 0.5
        points to a filter.

        Under chunk units the verdict is not taken (``_score``): there a request's
        first sightings are a new conversation's whole first turn (hundreds of chunks,
        mostly evicted unread) or a continued one's new tail (8-32 chunks, read at the
        next turn), so the share read counts the first kind and hides the second. The
        hybrid replay (2 groups, window 1,024, 10%, seed 1) read 5% of them again and
        the verdict moved the duel to second sighting, which declines every tail:
        42.66 hit % against 45.77 admitting all (whose shadow led by 7% at the end)."""
        self._useful += useful
        self._wasted += wasted
        total = self._useful + self._wasted
        if total >= self.fresh_trial:
            self._first_wasted = self._useful <= self.fresh_share * total
            if total >= 2 * self.fresh_trial:
                self._useful //= 2
                self._wasted //= 2

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
        moved = [k for k in inner.lru_order() if k in fresh]
        for k in moved:
            inner.discard(k)
        self.rejects.update(dict.fromkeys(moved))
        fresh.clear()

    def observe_read(self, keys: Sequence[OffloadKey]) -> None:
        """Show the shadows a read (``access``'s, or one the ARC structure served): a
        read starts a request."""
        self._reading = True
        self._after_offer = False
        a, b, c, d = self.tiers
        a.broken = b.broken = c.broken = d.broken = False
        sample = sampled(keys, self.rate_mask)
        self._prefix = sample
        if sample:
            self._score(sample)

    def observe_offer(self, keys: Sequence[OffloadKey]) -> None:
        """Show the shadows an offer (``admit``'s, or one the ARC structure takes): it
        starts a request unless an offer ended the last, and continues the read prefix."""
        self._reading = False
        if self._after_offer:
            a, b, c, d = self.tiers
            a.broken = b.broken = c.broken = d.broken = False
            self._prefix = ()
        self._after_offer = True
        sample = sampled(keys, self.rate_mask)
        if sample:
            self._score(sample)
            if self._prefix:
                self._behind_prefix()

    def _behind_prefix(self) -> None:
        """The offer just scored continues the request's read prefix. The real LRU arms
        store it behind that prefix (``hint_parent``: the chain list anchors a
        continuation behind its parent, so the chain's head stays newest); their shadows
        do the same by making the prefix most recent again. Without it a shadow ranks
        plain LRU, which evicts a cold chain from its head, and the duel takes ARC for
        the chain-aware LRU's equal (ARC itself is not chain-aware)."""
        prefix = self._prefix
        a, b, c, _ = self.tiers
        a.refresh(prefix)
        b.refresh(prefix)
        c.refresh(prefix)

    def _observe(self, keys: Sequence[OffloadKey]) -> None:
        (self.observe_read if self._reading else self.observe_offer)(keys)

    def _score(self, sample: Sequence[OffloadKey]) -> None:
        """The four shadows replay one call's sampled keys; the arms follow the scores."""
        a, b, c, d = self.tiers
        self._calls += 1
        decay = self._keep ** len(sample)
        if len(sample) == 1:
            key = sample[0]
            ha, hb, hc, hd = a.one(key), b.one(key), c.one(key), d.one(key)
        else:
            ha, hb, hc, hd = a.step(sample), b.step(sample), c.step(sample), d.step(sample)
        sa, sb, sc, sd = self.scores
        sa = sa * decay + ha
        sb = sb * decay + hb
        sc = sc * decay + hc
        sd = sd * decay + hd
        self.scores = [sa, sb, sc, sd]
        # As in chain_arms: BIP's shadow flatters it, second sighting must lead a little.
        eff = (sa, sb / self.second_lead, sc / self.bip_lead)
        noise = _no_noise
        if self._units:
            self._spread((ha, hb / self.second_lead, hc / self.bip_lead, hd), decay)
            noise = self._noise
        mode = self.mode
        # The first of the best, as max(range(3), key=eff.__getitem__) (ties keep the lower).
        best, top = 0, eff[0]
        if eff[1] > top:
            best, top = 1, eff[1]
        if eff[2] > top:
            best = 2
        # Leaving a filter for ALL is cheap (nothing kept is lost) and waiting costs a
        # chat its next turns' hits, so ALL needs only a small lead (half a shadow hit:
        # a tie must not pull a filter that just won back to ALL); a filter, which keeps
        # whatever ALL let in and is slow to undo, needs the margin.
        # Where the real tier's first sightings are evicted unread (``_first_wasted``),
        # second sighting takes over unless ALL's shadow leads it by the full margin,
        # and ALL needs that margin to come back.
        # Under chunk units every margin also has ``noise`` (``_noise``; 0 otherwise), and
        # the verdict is not taken (``_fates``).
        wasted = self._first_wasted and not self._units
        if wasted and mode == ALL and eff[0] <= eff[1] + self.switch_margin:
            best = SECOND
            margin = -math.inf
        elif best == ALL:
            margin = self.switch_margin if wasted else self.all_margin
        else:
            margin = self.switch_margin + self.filter_margin * eff[mode]
        if best != mode and eff[best] > eff[mode] + margin + noise(best, mode):
            if mode == ALL:
                self._demote_fresh()
            self.mode = mode = best
        lead = eff[mode]
        arc_margin = self.switch_margin + noise(ARC, mode)
        if self.choice == ARC:
            # Leave ARC only once the LRU arm leads it by the same margin.
            if lead > sd * (1.0 + self.arc_margin) + arc_margin:
                self.choice = mode
            return
        if sd > lead * (1.0 + self.arc_margin) + arc_margin:
            self.choice = ARC
        else:
            self.choice = mode

    def _spread(self, hits: tuple[float, float, float, float], decay: float) -> None:
        """Under chunk units: add one call's squared hit differences per pair of arms,
        decayed as the scores are (so ``_var`` is the variance of each score gap)."""
        var = self._var
        for p, (i, j) in enumerate(_PAIRS):
            gap = hits[i] - hits[j]
            var[p] = var[p] * decay + gap * gap

    def _noise(self, arm: int, mode: int) -> float:
        """The lead ``arm`` needs over ``mode`` beyond the margins, under chunk units:
        ``noise_z`` standard deviations of their score gap.

        A shadow samples 1 key in ``rate``, and a chunk-unit tier's request is a
        chain of hundreds of chunks that hit or miss together in a shadow: one
        conversation's turn moves a score by ~16 at once, so margins of 0.5-2 shadow
        hits let the duel switch on one request (hybrid replay, 2 groups, window
        1,024, 10%: ALL -> second -> ALL -> second -> ARC within 12 requests of ties).
        Each switch costs the real tier more than such a lead is worth: ALL -> a
        filter demotes the chunks ALL let in unread (there, the conversations' latest
        turns, which their next turns read), a switch of structure moves every key,
        and either leaves the tier in a state that no shadow, each running one arm
        throughout, has scored. With the arms within 1-3% of each other, the default
        fell 1-4 points behind every single arm.

        Between ALL and a filter (either way) the gate is scaled by twice the share of
        ALL's first sightings read again, at most 1: those are what leaving ALL
        demotes, so where they go unread (the Mooncake trace: 1 in 10) moving, and
        moving back, costs little and a filter's small lead is worth taking."""
        if arm == mode:
            return 0.0
        sigma = math.sqrt(self._var[_PAIR[arm][mode]])
        if ARC not in (arm, mode) and ALL in (arm, mode):
            total = self._useful + self._wasted
            if total:
                sigma *= min(1.0, self.leave_all_weight * self._useful / total)
        return self.noise_z * sigma

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
        """(keys seen once, keys read again, pinned keys), unpinned ones next victim first;
        then empty.

        Seen once: the rejects, then the kept keys ALL admitted on first sight and
        nobody read since (``_fresh``): ARC's T1, as ``give_resident`` takes T1 back.
        (Kept as read again, a conversation's turn just stored sat in T2 behind every
        older one-off, and ARC, whose T1 is what it evicts for new keys, lost its next
        turns: 7 points of a hybrid replay that moved to ARC midway.)
        O(capacity): only for a switch to the other structure."""
        once = list(self.rejects)
        kept = self.inner.lru_order()
        fresh = self._fresh
        if fresh:
            once += [k for k in kept if k in fresh]
            kept = [k for k in kept if k not in fresh]
        pinned = self.inner.pinned_keys() + list(self._pinned_rejects)
        self._reset_resident()
        return once, kept, pinned

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
