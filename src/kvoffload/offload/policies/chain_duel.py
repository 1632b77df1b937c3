"""Admission that is switched on only where it pays, by a duel of sampled shadow caches.

Second-sighting admission (``kvoffload.offload.policies.admission``) wins
where most new blocks are never read again (one-off prompts, long unique
suffixes) and loses where nearly every block is read again soon (a chat's
next turn reads all of this turn): there, the first reuse of every block is
lost. Which case holds changes with the workload, so two small shadow caches
replay a fixed sample of the keys (1 key in ``rate`` by a byte of its hash,
at ``capacity / rate`` slots; ``rate`` is a power of two up to 16 that leaves
each shadow ``min_shadow`` slots or more, 1 for small tiers): an LRU that
admits everything and an LRU with
second-sighting admission. A decayed difference of their hits decides, at
each store, whether new keys are admitted at once (as plain LRU does) or only
on their second sighting. This is set dueling (Qureshi et al., ISCA 2007);
the shadows only see keys, at O(1) per sampled key.

The sample is by key bytes, so the same trace always gives the same result.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.admission import SecondSightPolicy
from kvoffload.offload.policies.default.chain_lru import ChainLRUPolicy


class _ShadowLRU:
    """Keys only: an LRU of ``capacity`` that admits all, or only second sightings."""

    def __init__(self, capacity: int, admission: bool, history: int) -> None:
        self.capacity = capacity
        self.admission = admission
        self.main: OrderedDict[OffloadKey, None] = OrderedDict()
        self.rejects: OrderedDict[OffloadKey, None] = OrderedDict()
        self.seen: OrderedDict[OffloadKey, None] = OrderedDict()
        self.history = history

    def access(self, key: OffloadKey) -> bool:
        """Read ``key``: whether it hit; a miss stores it."""
        main = self.main
        if key in main:
            main.move_to_end(key)
            return True
        hit = key in self.rejects
        if hit:
            del self.rejects[key]
            main[key] = None
        elif not self.admission:
            main[key] = None
        else:
            seen = self.seen
            if key in seen:
                main[key] = None
            else:
                self.rejects[key] = None
                seen[key] = None
                if len(seen) > self.history:
                    seen.popitem(last=False)
        while len(main) + len(self.rejects) > self.capacity:
            (self.rejects or main).popitem(last=False)
        return hit


class DuelingAdmission(SecondSightPolicy):
    """Second-sighting admission in front of ``inner_cls``, on only while it wins the duel."""

    adaptive_share = False
    max_rate = 16  # sample at most 1 key in 16 ...
    min_shadow = 128  # ... keeping at least this many slots per shadow (less noise)
    margin = 0.0  # admit everything only while the duel score exceeds this
    window = 32.0  # decay of the duel score, in shadow capacities' worth of sampled reads

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        rate = 1
        while rate < self.max_rate and capacity // (2 * rate) >= self.min_shadow:
            rate *= 2
        self.rate_mask = rate - 1
        shadow_cap = max(1, capacity // rate)
        history = max(1, self._history_size // rate)
        self.shadow_all = _ShadowLRU(shadow_cap, admission=False, history=history)
        self.shadow_admit = _ShadowLRU(shadow_cap, admission=True, history=history)
        self.score = 0.0  # > 0: admitting everything hit more lately
        self._keep = 1.0 - 1.0 / (self.window * shadow_cap)

    def _observe(self, keys: Sequence[OffloadKey]) -> None:
        mask = self.rate_mask
        a, b, keep = self.shadow_all, self.shadow_admit, self._keep
        score = self.score
        for k in keys:
            if len(k) > 4 and (k[-5] & mask) == 0:
                score = score * keep + (a.access(k) - b.access(k))
        self.score = score

    def admit_all(self) -> bool:
        return self.score > self.margin

    def access(self, keys: Sequence[OffloadKey]) -> None:
        self._observe(keys)
        super().access(keys)

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        self._observe(incoming)
        return super().evict(n, incoming)


class DuelChainLRUPolicy(DuelingAdmission):
    """Chain-aware LRU (``chain_lru``) behind dueling second-sighting admission: the default.

    Where admission does not pay it is ``chain_lru`` (a chain's continuation
    kept behind its prefix, as vLLM's LRU orders a finished request), where it
    does, one-off blocks stay out of the way of reused ones.
    """

    name = "chain_duel"
    inner_cls = ChainLRUPolicy
