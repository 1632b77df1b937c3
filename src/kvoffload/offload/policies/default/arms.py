"""Three admission modes in front of chain-aware LRU, chosen by a duel of sampled shadow caches.

An earlier stage of the default (``chain_duel``, in git history) chose
between admitting every new key and admitting only second sightings. Neither
survives a loop: a cyclic working set larger than the tier (a few long
prompts sent in turn) is all second sightings, and LRU evicts each block
just before its next use, so the tier serves nothing. The third mode here is
bimodal insertion (BIP, Qureshi et al., ISCA 2007): only about one store in
``bip_period`` is admitted, the others go to the reject FIFO that is evicted
first, so the tier keeps the part of the loop it holds and serves it every
cycle, and still turns over slowly when the working set moves. A store is
admitted or not as a whole, so chains stay whole; until the
tier first fills, every store is admitted (there is nothing to protect yet).

Three shadow LRUs of ``capacity / rate`` slots replay a fixed sample of the
keys (1 in ``rate`` by the hash's last byte, ``sampled``): one per mode.
Each keeps a decayed hit score; the real cache follows the best one, and
leaves its current mode only for a score better by ``switch_margin`` (in
shadow hits), so noise does not flip it. This is set dueling over three arms;
the shadows see only keys, at O(1) per sampled key.

Everything is decided by key bytes and the order of calls, so the same trace
always gives the same result.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat, starmap
from typing import ClassVar

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.admission import SecondSightPolicy
from kvoffload.offload.policies.default.chain_lru import ChainLRUPolicy

ALL, SECOND, BIP = 0, 1, 2
MODE_NAMES = ("all", "second", "bip")
_OLDEST = (False,)  # popitem's argument: the least recent item


#: Runs an iterator of calls to its end in C (a zero-length deque keeps nothing); a
#: bound C method, so no Python frame per use.
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


def sampled(keys: Sequence[OffloadKey], mask: int) -> Sequence[OffloadKey]:
    """The shadows' fixed sample of ``keys``: 1 in ``mask + 1`` by the hash's last byte.

    A key is sampled by ``key[-1] ^ key[-5]``, which holds the block hash's last
    byte whatever the key's shape: an ``OffloadKey`` (hash + 4-byte group index)
    has it at ``[-5]`` and its group index's low byte at ``[-1]`` (0 for a tier of
    one group: the sample is ``[-5]``'s alone), a chunk unit (``chunk_units``: the
    hash without the group index) has it at ``[-1]`` and another hash byte at
    ``[-5]``. Reading ``[-5]`` alone sampled a unit by its hash's fifth-last byte,
    which is 0 for every integer-derived id up to 2**32 (trace ids, Mooncake's
    hash ids): every key went to shadows sized for 1 in 16, and the duel judged a
    tier 16 times too small (where second sighting wins).
    """
    if not mask:
        return keys
    return [k for k in keys if not (k[-1] ^ k[-5]) & mask]


class _Shadow:
    """Keys only: an LRU of ``capacity`` in front of which one admission mode runs."""

    __slots__ = ("bip_period", "broken", "capacity", "history", "main", "mode", "rejects", "seen")

    def __init__(self, capacity: int, mode: int, history: int, bip_period: int) -> None:
        self.capacity = capacity
        self.mode = mode
        self.main: OrderedDict[OffloadKey, None] = OrderedDict()
        self.rejects: OrderedDict[OffloadKey, None] = OrderedDict()
        self.seen: OrderedDict[OffloadKey, None] = OrderedDict()
        self.history = history
        self.bip_period = bip_period
        self.broken = False  # ``run_lead``: this request's reads already missed

    def run(self, keys: Sequence[OffloadKey], bip_admit: bool) -> int:
        """Read ``keys`` in turn; how many hit. A miss stores the key under this mode
        (BIP: if ``bip_admit`` or its main part is not full yet, as the real cache)."""
        return self.run_lead(keys, bip_admit, False)

    def run_lead(self, keys: Sequence[OffloadKey], bip_admit: bool, lead: bool) -> int:
        """``run``; with ``lead``, hits count only until the first miss, which sets
        ``broken`` (the caller clears it when a request starts): a lookup counts only
        a chain's leading stored blocks, and a shadow should score as the tier does."""
        if self.mode == ALL:
            return self._run_all(keys, lead)
        main, rejects, cap, mode = self.main, self.rejects, self.capacity, self.mode
        seen, history = self.seen, self.history
        hits = 0
        broken = lead and self.broken
        for key in keys:
            if key in main:
                main.move_to_end(key)
                if not broken:
                    hits += 1
                continue
            if key in rejects:
                del rejects[key]
                main[key] = None
                if not broken:
                    hits += 1
                continue
            broken = lead
            if mode == SECOND:
                if key in seen:
                    main[key] = None
                else:
                    rejects[key] = None
                    seen[key] = None
                    if len(seen) > history:
                        seen.popitem(last=False)
            elif bip_admit or len(main) < cap:
                main[key] = None
            else:
                rejects[key] = None
            if len(main) + len(rejects) > cap:
                (rejects or main).popitem(last=False)
        self.broken = broken
        return hits

    def _run_all(self, keys: Sequence[OffloadKey], lead: bool = False) -> int:
        """``run_lead`` for plain LRU (no rejects ever): the most read shadow, kept lean."""
        main, cap = self.main, self.capacity
        hits = 0
        broken = lead and self.broken
        for key in keys:
            if key in main:
                main.move_to_end(key)
                if not broken:
                    hits += 1
            else:
                broken = lead
                main[key] = None
                if len(main) > cap:
                    main.popitem(last=False)
        self.broken = broken
        return hits


class ArmsChainLRUPolicy(SecondSightPolicy):
    """Chain-aware LRU behind the best of three admission modes (all, second sighting, BIP)."""

    name = "chain_arms"
    inner_cls = ChainLRUPolicy
    adaptive_share = False
    max_rate: ClassVar[int] = 16  # sample at most 1 key in 16 ...
    min_shadow: ClassVar[int] = 128  # ... keeping at least this many slots per shadow
    window: ClassVar[float] = 32.0  # score decay, in shadow capacities' worth of sampled reads
    bip_period: ClassVar[int] = 32  # BIP admits about one store in this many
    switch_margin: ClassVar[float] = 2.0  # shadow hits a new mode must lead by
    second_lead: ClassVar[float] = 1.0  # the same for second sighting
    bip_lead: ClassVar[float] = 3.0  # BIP's shadow hits must be this many times the others'

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        rate = 1
        while rate < self.max_rate and capacity // (2 * rate) >= self.min_shadow:
            rate *= 2
        self.rate_mask = rate - 1
        shadow_cap = max(1, capacity // rate)
        history = max(1, self._history_size // rate)
        self.shadows = [
            _Shadow(shadow_cap, m, history, self.bip_period) for m in (ALL, SECOND, BIP)
        ]
        self.scores = [0.0, 0.0, 0.0]
        self._stores = 0
        self._calls = 0  # observed calls with sampled keys (the BIP shadow's admission clock)
        self._max_store = 0  # the most new keys one store has brought
        self._pinned_rejects: set[OffloadKey] = set()
        self._offered: dict[OffloadKey, bool] | None = None  # ``admit``'s last decisions
        self._offered_all = False  # ... all of them True
        self.mode = SECOND  # until the shadows have seen enough: measured safer than ALL
        self._keep = 1.0 - 1.0 / (self.window * shadow_cap)

    def _observe(self, keys: Sequence[OffloadKey]) -> None:
        sample = sampled(keys, self.rate_mask)
        if not sample:
            return
        a, b, c = self.shadows
        bip_admit = self._calls % self.bip_period == 0
        self._calls += 1
        # Scores decay per sampled read; within one call the reads count as one batch.
        decay = self._keep ** len(sample)
        sa, sb, sc = self.scores
        sa = sa * decay + a.run(sample, False)
        sb = sb * decay + b.run(sample, False)
        sc = sc * decay + c.run(sample, bip_admit)
        self.scores = [sa, sb, sc]
        # BIP's shadow flatters it (per key, where the real cache admits per store):
        # it must lead by a factor, which a loop (where the others hit ~0) gives.
        eff = (sa, sb / self.second_lead, sc / self.bip_lead)
        cur = self.mode
        best = max(range(3), key=eff.__getitem__)
        if best != cur and eff[best] > eff[cur] + self.switch_margin:
            self.mode = best

    def admit_all(self) -> bool:
        return self.mode == ALL

    # In BIP mode a reject read again is promoted only while the inner policy has
    # room beside the largest store: otherwise the next large store would evict
    # kept keys to make room, and a loop would shrink the kept part each cycle.
    # A reject that stays one is refreshed (newest in the FIFO); pinned, it waits
    # in ``_pinned_rejects`` and returns to the FIFO when unpinned.

    def _room(self) -> int:
        if self.mode != BIP:
            return 1 << 62
        return self.capacity - self._max_store - len(self.inner)

    def _split_rejects(
        self, keys: Sequence[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """(rejects among ``keys`` to promote, rejects that stay rejects); both leave the FIFO."""
        rejects = self.rejects
        room = self._room()
        up: list[OffloadKey] = []
        stay: list[OffloadKey] = []
        for k in keys:
            if rejects.pop(k, rejects) is None:
                (up if len(up) < room else stay).append(k)
        return up, stay

    def __len__(self) -> int:
        return super().__len__() + len(self._pinned_rejects)

    def __contains__(self, key: object) -> bool:
        return key in self._pinned_rejects or super().__contains__(key)

    def is_pinned(self, key: OffloadKey) -> bool:
        """Whether resident ``key`` is pinned (rejects never are, unless held aside)."""
        if key in self._pinned_rejects:
            return True
        return key not in self.rejects and self.inner.is_pinned(key)  # type: ignore[attr-defined]

    def discard(self, key: OffloadKey) -> None:
        if key in self._pinned_rejects:
            self._pinned_rejects.discard(key)
        else:
            super().discard(key)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """``SecondSightPolicy.insert`` (admitted keys to the LRU, the rest to the rejects,
        tail first), asking the LRU's node map directly: no method call per key."""
        admit = self._admit
        kept = list(filter(admit.__contains__, keys))
        if kept:
            admit.difference_update(kept)
            self.inner.insert(kept)
        if len(kept) < len(keys):
            rejects = self.rejects
            nodes = self.inner._nodes  # type: ignore[attr-defined]
            for k in keys[::-1]:
                if k not in nodes:
                    rejects[k] = None

    def observe(self, keys: Sequence[OffloadKey]) -> None:
        """Show the shadows reads of keys this policy does not hold (a wrapper holds them)."""
        self._observe(keys)

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self._observe(keys)
        self.access_unobserved(keys)

    def access_unobserved(self, keys: Sequence[OffloadKey]) -> None:
        """``access`` without showing the shadows (they saw these reads already)."""
        rejects = self.rejects
        if not self._pinned_rejects and (not rejects or rejects.keys().isdisjoint(keys)):
            self.inner.access(keys)  # no reject among them: nothing to promote or refresh
            return
        up, stay = self._split_rejects(keys)
        if up:
            self.inner.insert(up)
        rejects = self.rejects
        for k in stay:
            rejects[k] = None
        if stay:
            kept = set(stay)
            self.inner.access([k for k in keys if k not in kept and k not in self._pinned_rejects])
        else:
            self.inner.access([k for k in keys if k not in self._pinned_rejects])

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        rejects = self.rejects
        if not rejects or rejects.keys().isdisjoint(keys):
            self.inner.pin(keys)  # no reject among them (the usual load)
            return
        up, stay = self._split_rejects(keys)
        if up:
            self.inner.insert(up)
        if stay:
            self._pinned_rejects.update(stay)
            kept = set(stay)
            keys = [k for k in keys if k not in kept]
        self.inner.pin(keys)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        pr = self._pinned_rejects
        if pr:
            back = [k for k in keys if k in pr]
            if back:
                pr.difference_update(back)
                rejects = self.rejects
                for k in back:
                    rejects[k] = None
                keys = [k for k in keys if k not in rejects]
        self.inner.unpin(keys)

    # Admission asked ahead (``admit``): the same decision the store's ``evict`` makes
    # (same shadows, history and BIP clock), taken before the manager makes room, so a
    # declined key need not be stored at all. Declined keys are still stored where that
    # costs no kept key (free slots and the reject FIFO's, beyond the admitted ones):
    # there they are rejects, as before. The decisions wait in ``_offered`` for the
    # store's ``evict``, which then neither observes nor decides again.

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        self._offered = None
        if not keys:
            return None
        self._observe(keys)
        return self._decide(keys, in_flight)

    def _decide(self, keys: Sequence[OffloadKey], in_flight: int) -> list[bool]:
        """``admit``'s answer for non-empty ``keys`` the shadows have just seen."""
        n = len(keys)
        if n > self._max_store:
            self._max_store = min(n, self.capacity // 2)
        history, mode = self.history, self.mode
        if mode == SECOND and len(set(keys)) < n:
            # A key repeated within the call is a second sighting at its repeat.
            decided = []
            for k in keys:
                if k in history:
                    history.move_to_end(k)
                    decided.append(True)
                else:
                    history[k] = None
                    decided.append(False)
            every = all(decided)
        else:
            if mode == SECOND:
                decided = list(map(history.__contains__, keys))
                every = all(decided)
            else:
                every = True
                if mode == BIP:
                    self._stores += 1
                    every = n <= self._room() or self._stores % self.bip_period == 0
                decided = [every] * n
            # Every key ends most recent, in call order. (OrderedDict.update and slot
            # wrappers such as __setitem__ are slower than this loop; move_to_end is not.
            # A second sighting of every key has them all in the history already.)
            if mode != SECOND or not every:
                for k in keys:
                    history[k] = None
            _consume(map(history.move_to_end, keys))
        over = len(history) - self._history_size
        if over > 0:
            _consume(starmap(history.popitem, repeat(_OLDEST, over)))
        # (One decision for all keys outside SECOND: no pairing needed.)
        self._offered = dict(zip(keys, decided)) if mode == SECOND else dict.fromkeys(keys, every)
        self._offered_all = every
        if every:
            return decided
        spare = (
            self.capacity - len(self.inner) - len(self._pinned_rejects) - in_flight - sum(decided)
        )
        if spare <= 0:
            return decided
        # Declined keys fill the spare slots, head first.
        for i, f in enumerate(decided):
            if not f:
                decided[i] = True
                spare -= 1
                if spare <= 0:
                    break
        return decided

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        offered, self._offered = self._offered, None
        if offered is not None and incoming and all(map(offered.__contains__, incoming)):
            return self._evict_decided(n, incoming, offered)
        self._observe(incoming)
        if len(incoming) > self._max_store:
            self._max_store = min(len(incoming), self.capacity // 2)
        if self.mode != BIP or not incoming:
            return super().evict(n, incoming)
        # BIP: a store is admitted whole or not at all (chains stay whole): while the
        # inner policy holds less than the tier minus the largest store (the room the
        # rejects need, so that storing them never evicts kept keys), then one store in N.
        self._stores += 1
        admit = len(incoming) <= self._room() or self._stores % self.bip_period == 0
        history = self.history
        for k in incoming:
            history[k] = None
            history.move_to_end(k)
        while len(history) > self._history_size:
            history.popitem(last=False)
        if admit:
            self._admit.update(incoming)
        admitted = list(incoming) if admit else []
        if n == 0:
            self.inner.evict(0, admitted)
            return []
        rejects, inner = self.rejects, self.inner
        r = min(n, len(rejects))
        r = max(r, n - inner.num_evictable())
        victims = [rejects.popitem(last=False)[0] for _ in range(r)]
        return victims + inner.evict(n - r, admitted)

    def _evict_decided(
        self, n: int, incoming: Sequence[OffloadKey], offered: dict[OffloadKey, bool]
    ) -> list[OffloadKey]:
        """``evict`` for a store whose keys ``admit`` judged (observed and decided there)."""
        if self._offered_all:
            admitted = incoming
        else:
            admitted = list(compress(incoming, map(offered.__getitem__, incoming)))
        admit = self._admit
        admit.update(admitted)
        if len(admit) > self._history_size:
            admit.clear()  # stores that never completed; forgetting them only delays admission
        if n == 0:
            return []  # (the chain list's evict(0) changes nothing)
        rejects, inner = self.rejects, self.inner
        k = max(min(n, len(rejects)), n - inner.num_evictable())
        if not k:
            return inner.evict(n, admitted)
        victims = [rejects.popitem(last=False)[0] for _ in range(k)]
        return victims + inner.evict(n - k, admitted)
