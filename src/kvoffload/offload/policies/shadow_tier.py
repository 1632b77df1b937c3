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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.arc_arm import ArcArm

ALL, SECOND, BIP, ARC = 0, 1, 2, 3


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
        "rejects",
        "seen",
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

    def __len__(self) -> int:
        return len(self.arc) if self.arc is not None else len(self.lru) + len(self.rejects)

    def run(self, keys: Sequence[OffloadKey]) -> int:
        """Replay one call's keys (head first); how many count as hits."""
        arc = self.arc
        # An ARC shadow has no pins: its resident keys are T1's and T2's.
        held, rejects = (arc.t1, arc.t2) if arc is not None else (self.lru, self.rejects)
        present: list[OffloadKey] = []
        missing: list[OffloadKey] = []
        hits = 0
        counting = not self.broken
        for key in keys:
            if key in held or key in rejects:
                present.append(key)
                if counting:
                    hits += 1
            else:
                missing.append(key)
                counting = False
        if missing:
            self.broken = True
        if arc is not None:
            if present:
                arc.access(present)
            if missing:
                new = missing[: self.capacity]
                over = len(arc) + len(new) - self.capacity
                arc.evict(max(0, over), new)
                arc.insert(new)
            return hits
        lru, rejects = self.lru, self.rejects
        for key in reversed(present):
            if rejects and rejects.pop(key, rejects) is None:
                lru[key] = None  # a reject read again is promoted: its reuse proved it
            else:
                lru.move_to_end(key)
        if not missing:
            return hits
        offered = missing[: self.capacity]
        new = self._admitted(offered)
        cap = self.capacity
        if new:
            over = len(lru) + len(rejects) + len(new) - cap
            while over > 0 and rejects:
                rejects.popitem(last=False)
                over -= 1
            for _ in range(over):
                lru.popitem(last=False)
            for key in reversed(new):
                lru[key] = None
        if len(new) < len(offered):
            # Declined keys take only what costs no kept key: free slots and old rejects.
            if new:
                admitted = set(new)
                declined = [k for k in offered if k not in admitted][: cap - len(lru)]
            else:  # all declined (BIP's usual case)
                declined = offered[: cap - len(lru)]
            over = len(lru) + len(rejects) + len(declined) - cap
            for _ in range(max(0, over)):
                rejects.popitem(last=False)
            for key in reversed(declined):
                rejects[key] = None
        return hits

    def _admitted(self, offered: list[OffloadKey]) -> list[OffloadKey]:
        mode = self.mode
        if mode == ALL:
            return offered
        if mode == BIP:
            self.stores += 1
            if len(self.lru) + len(offered) <= self.capacity - len(offered):
                return offered
            return offered if self.stores % self.bip_period == 0 else []
        seen = self.seen
        out = []
        for key in offered:
            if key in seen:
                seen.move_to_end(key)
                out.append(key)
            else:
                seen[key] = None
        while len(seen) > self.history:
            seen.popitem(last=False)
        return out
