"""Shadow tiers for the policy duel: a few slots replaying sampled keys call by call, as the tier.

A shadow that replays key by key misjudges a tier whose requests are long
beside it (an agent's 60-block context in a 63-block tier): reading a chain
head first and evicting at each miss, the chain's own tail pushes out its
head, which the real tier (head most recent, room made per store) never
does; a per-key ARC shadow scored ARC 34.6% where the real one serves 20.8%.
So each shadow here takes a call as the tier does:

- hits: the call's keys resident before it, counted only up to the request's
  first miss (``broken``, cleared by the caller at each new request), since a
  lookup counts only a chain's leading stored blocks;
- resident keys are read (``access``, chain order: head most recent);
- the missing keys (at most the shadow's capacity, head first) are offered:
  the arm's admission decides, and room for the admitted ones is made by one
  ``evict`` before one ``insert``, as ``prepare_store`` / ``complete_store``.

Arms: ``ALL`` (LRU, admit everything), ``SECOND`` (LRU, admit a key offered
before within ``history`` offers), ``BIP`` (LRU, admit a whole store while
the LRU has room for it, else one store in ``bip_period``), ``ARC``
(``ArcArm``, which admits everything). The LRU is an ordered dict of keys
(least recent first): no per-key allocation but the dict's. Invariant:
at most ``capacity`` keys resident. Deterministic.

Speed (the four shadows see every sampled key of every call, so they are a
large share of the default policy's time): each arm's ``step`` is its own
function (no per-call dispatch on the arm), splits a call by C-level passes
(``isdisjoint``, ``filterfalse``, ``map``) rather than per-key bytecode, and
``one(key)`` unrolls ``step([key])``, the usual call on a large tier where 1
key in 16 is sampled (``tests/offload/test_shadow_steps.py`` holds them equal).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse, repeat, starmap

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.default.arc_arm import ArcArm

ALL, SECOND, BIP, ARC = 0, 1, 2, 3
_OLDEST = (False,)  # popitem's argument: the least recent item


#: Runs an iterator of calls to its end in C (a zero-length deque keeps nothing); a
#: bound C method, so no Python frame per use.
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


class ShadowTier:
    """One arm's tier of ``capacity`` slots over sampled keys; ``run`` scores one call."""

    __slots__ = (
        "arc",
        "bip_period",
        "broken",
        "capacity",
        "history",
        "lru",
        "mode",
        "one",
        "rejects",
        "seen",
        "step",
        "stores",
    )

    def __init__(self, capacity: int, mode: int, history: int, bip_period: int) -> None:
        self.capacity = capacity
        self.mode = mode
        self.history = history
        self.bip_period = bip_period
        self.lru: OrderedDict[OffloadKey, None] = OrderedDict()  # kept keys, least recent first
        self.rejects: OrderedDict[OffloadKey, None] = OrderedDict()  # declined, evicted first
        self.arc = ArcArm(capacity) if mode == ARC else None
        self.seen: OrderedDict[OffloadKey, None] = OrderedDict()  # SECOND's offers, oldest first
        self.stores = 0  # BIP's clock
        self.broken = False  # this request's reads already missed
        self.step: Callable[[Sequence[OffloadKey]], int] = (
            self._run_all if mode == ALL else self._run_arc if mode == ARC else self._run_lru
        )
        # ``step([key])`` for a call of one sampled key (most calls on a large tier).
        self.one: Callable[[OffloadKey], int] = (
            self._one_all if mode == ALL else self._one_arc if mode == ARC else self._one_lru
        )

    def __len__(self) -> int:
        return len(self.arc) if self.arc is not None else len(self.lru) + len(self.rejects)

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` keys from now on; the excess goes as the arm evicts
        (rejects first, then the least recent kept keys; ARC by its rule)."""
        self.capacity = capacity
        if self.arc is not None:
            self.arc.resize(capacity)
            return
        lru, rejects = self.lru, self.rejects
        over = len(lru) + len(rejects) - capacity
        if over > 0:
            r = min(over, len(rejects))
            _consume(starmap(rejects.popitem, repeat(_OLDEST, r)))
            _consume(starmap(lru.popitem, repeat(_OLDEST, over - r)))

    def refresh(self, keys: Sequence[OffloadKey]) -> None:
        """Make those of ``keys`` (head first) still kept the most recent, head newest."""
        lru = self.lru
        _consume(map(lru.move_to_end, reversed([k for k in keys if k in lru])))

    def run(self, keys: Sequence[OffloadKey]) -> int:
        """Replay one call's keys (head first); how many count as hits."""
        return self.step(keys) if keys else 0

    # ``step`` is one of the three below, chosen by the arm: each takes a non-empty call.
    # Every test of membership comes before any change (present / missing are as of
    # before the call), done by C-level passes; a call whose keys are all new to the
    # shadow (the usual offer) is told by one ``isdisjoint``.

    def _run_all(self, keys: Sequence[OffloadKey]) -> int:
        """ALL: LRU that admits every key (it never has rejects)."""
        lru = self.lru
        if lru.keys().isdisjoint(keys):
            hits = 0
            missing: Sequence[OffloadKey] = keys
        else:
            missing = list(filterfalse(lru.__contains__, keys))
            if missing:
                hits = 0 if self.broken else keys.index(missing[0])  # up to the first miss
                _consume(map(lru.move_to_end, reversed([k for k in keys if k in lru])))
            else:
                hits = 0 if self.broken else len(keys)
                _consume(map(lru.move_to_end, reversed(keys)))  # head most recent
                return hits
        self.broken = True
        cap = self.capacity
        offered = missing[:cap]
        over = len(lru) + len(offered) - cap
        if over > 0:
            if over == len(lru):
                lru.clear()  # a call as large as the shadow replaces it
            else:
                _consume(starmap(lru.popitem, repeat(_OLDEST, over)))
        for key in reversed(offered):
            lru[key] = None
        return hits

    def _run_arc(self, keys: Sequence[OffloadKey]) -> int:
        """ARC (``ArcArm``, no pins: its resident keys are T1's and T2's)."""
        arc = self.arc
        assert arc is not None
        t1, t2 = arc.t1, arc.t2
        present: Sequence[OffloadKey]
        if t1.keys().isdisjoint(keys) and t2.keys().isdisjoint(keys):
            present, missing = (), keys
        else:
            missing = list(filterfalse(t1.__contains__, keys))
            if missing:
                missing = list(filterfalse(t2.__contains__, missing))
            present = list(filterfalse(set(missing).__contains__, keys)) if missing else keys
        if missing:
            hits = 0 if self.broken else keys.index(missing[0])
            self.broken = True
        else:
            hits = 0 if self.broken else len(keys)
        if present:
            arc.access(present)
        if missing:
            cap = self.capacity
            new = missing[:cap]
            over = len(t1) + len(t2) + len(new) - cap
            arc.evict(max(0, over), new)
            arc.insert(new)
        return hits

    def _run_lru(self, keys: Sequence[OffloadKey]) -> int:
        """SECOND or BIP: LRU behind an admission filter, declined keys in a reject FIFO."""
        lru, rejects = self.lru, self.rejects
        present: Sequence[OffloadKey]
        if lru.keys().isdisjoint(keys) and (not rejects or rejects.keys().isdisjoint(keys)):
            present, missing = (), keys  # the usual offer: all new to the shadow
        else:
            missing = list(filterfalse(lru.__contains__, keys))
            if rejects and missing:
                missing = list(filterfalse(rejects.__contains__, missing))
            present = list(filterfalse(set(missing).__contains__, keys)) if missing else keys
        # Hits count up to the request's first miss: that miss's first position.
        if missing:
            hits = 0 if self.broken else keys.index(missing[0])
            self.broken = True
        else:
            hits = 0 if self.broken else len(keys)
        if present:
            # Each read key ends most recent, tail first (head newest); a reject read
            # again is promoted (its reuse proved it), so it leaves the FIFO first.
            if rejects:
                up = list(filterfalse(lru.__contains__, present))
                if up:
                    _consume(map(rejects.pop, up, repeat(None)))
                    for key in up:
                        lru[key] = None
            _consume(map(lru.move_to_end, reversed(present)))
        if not missing:
            return hits
        cap = self.capacity
        offered = missing[:cap]
        new = self._admitted(offered)
        if new:
            over = len(lru) + len(rejects) + len(new) - cap
            if over > 0:
                r = min(over, len(rejects))
                if r:
                    _consume(starmap(rejects.popitem, repeat(_OLDEST, r)))
                if over > r:
                    _consume(starmap(lru.popitem, repeat(_OLDEST, over - r)))
            for key in reversed(new):
                lru[key] = None
        if len(new) < len(offered):
            # Declined keys take only what costs no kept key: free slots and old rejects.
            declined: Sequence[OffloadKey]
            if new:
                admitted = set(new)
                declined = [k for k in offered if k not in admitted][: cap - len(lru)]
            else:  # all declined (BIP's usual case)
                declined = offered[: cap - len(lru)]
            over = len(lru) + len(rejects) + len(declined) - cap
            if over > 0:
                _consume(starmap(rejects.popitem, repeat(_OLDEST, over)))
            for key in reversed(declined):
                rejects[key] = None
        return hits

    # ``one(key)``: ``step([key])`` unrolled, the same state changes (one key cannot
    # repeat, and a one-key offer evicts at most one).

    def _one_all(self, key: OffloadKey) -> int:
        lru = self.lru
        if key in lru:
            lru.move_to_end(key)
            return 0 if self.broken else 1
        self.broken = True
        if len(lru) >= self.capacity:
            lru.popitem(last=False)
        lru[key] = None
        return 0

    def _one_lru(self, key: OffloadKey) -> int:
        lru, rejects = self.lru, self.rejects
        if key in lru:
            lru.move_to_end(key)
            return 0 if self.broken else 1
        if key in rejects:
            del rejects[key]  # promoted: read again
            lru[key] = None
            return 0 if self.broken else 1
        self.broken = True
        cap = self.capacity
        if self._admitted([key]):
            if len(lru) + len(rejects) >= cap:
                (rejects or lru).popitem(last=False)
            lru[key] = None
        elif len(lru) < cap:  # declined: a reject, if that costs no kept key
            if len(lru) + len(rejects) >= cap:
                rejects.popitem(last=False)
            rejects[key] = None
        return 0

    def _one_arc(self, key: OffloadKey) -> int:
        arc = self.arc
        assert arc is not None
        t2 = arc.t2
        if key in t2:
            t2.move_to_end(key)
            return 0 if self.broken else 1
        t1 = arc.t1
        if key in t1:  # used again: T1 -> T2
            del t1[key]
            t2[key] = None
            arc.n1 -= 1
            arc.n2 += 1
            return 0 if self.broken else 1
        self.broken = True
        arc.offer_one(key)
        return 0

    def _admitted(self, offered: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        mode = self.mode
        if mode == ALL:
            return offered
        if mode == BIP:
            self.stores += 1
            if len(self.lru) + len(offered) <= self.capacity - len(offered):
                return offered
            return offered if self.stores % self.bip_period == 0 else []
        seen = self.seen
        if all(map(seen.__contains__, offered)):
            # All offered before (a loop's usual call): all admitted, each most recent.
            _consume(map(seen.move_to_end, offered))
            return list(offered)
        out = []
        for key in offered:
            if key in seen:
                seen.move_to_end(key)
                out.append(key)
            else:
                seen[key] = None
        over = len(seen) - self.history
        if over > 0:
            _consume(starmap(seen.popitem, repeat(_OLDEST, over)))
        return out
