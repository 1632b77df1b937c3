"""ARC as one arm of the policy duel: ``arc``'s structure, plus what switching arms needs.

The replacement rule and its state are ``ARCPolicy``'s (the tier's ``arc``:
T1 / T2 resident, ghost lists B1 / B2, target share ``p``; a pinned key keeps
its list label but is in neither ordered list). What this class adds for
``PolicyDuel`` (which moves the resident keys from one arm's structure to the
other's when the duel changes its mind): ``discard`` (forget one resident
key, pinned or not: the queue wrapper evicts protected keys by name),
``export`` (the unpinned keys in their lists' orders) and ``load`` (start
from given T1 / T2 contents and pins).

One rule differs from ``arc``: the ghost lists keep the paper's bound,
|T1| + |B1| <= c and 2c keys in all, resident ones included. With ``arc``'s
per-list bound in both the shadow and the real arm, the duel moves to ARC
more often and loses there on the Mooncake synthetic trace (1%: 4.03 -> 3.54
hit %, 5%: 16.26 -> 15.83, both below vLLM's best) for a little elsewhere
(sum of deltas to vLLM's best over 88 trace points +25.4 -> +27.6; points
below it 16 -> 15). Invariants: ``ARCPolicy``'s with that bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import repeat, starmap

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.arc import _OLDEST, T1, T2, ARCPolicy, _consume

__all__ = ["T1", "T2", "ArcArm"]


class ArcArm(ARCPolicy):
    """ARC over the resident keys of a tier, able to be loaded from and exported to another arm."""

    name = "arc_arm"

    @property
    def pinned(self) -> set[OffloadKey]:
        """The pinned resident keys."""
        return set(self._pinned)

    @property
    def where(self) -> dict[OffloadKey, int]:
        """Every resident key -> T1 or T2 (O(n): for switches and tests)."""
        out = dict.fromkeys(self.t1, T1)
        out.update(dict.fromkeys(self.t2, T2))
        out.update(self._pinned)
        return out

    def is_pinned(self, key: OffloadKey) -> bool:
        """Whether resident ``key`` is pinned."""
        return key in self._pinned

    def discard(self, key: OffloadKey) -> None:
        """Forget resident ``key`` (pinned or not) without remembering it as a ghost."""
        label = self._pinned.pop(key, None)
        if label is None:
            if key in self.t1:
                del self.t1[key]
                label = T1
            else:
                del self.t2[key]
                label = T2
        if label == T1:
            self.n1 -= 1
        else:
            self.n2 -= 1

    def _trim_ghosts(self) -> None:
        """The paper's bound: |T1| + |B1| <= c, then 2c keys in all (B2's oldest first)."""
        c = self.capacity
        b1, b2 = self.b1, self.b2
        pop1 = b1.popitem
        # (Pops run in C: ``repeat`` with a count <= 0 gives nothing, as ``range`` would.)
        _consume(starmap(pop1, repeat(_OLDEST, min(len(b1), self.n1 + len(b1) - c))))
        over = self.n1 + self.n2 + len(b1) + len(b2) - 2 * c
        if over > 0:
            k = min(over, len(b2))
            _consume(starmap(b2.popitem, repeat(_OLDEST, k)))
            # (At most B1 whole: a retargeted ``c`` may be below the resident keys.)
            _consume(starmap(pop1, repeat(_OLDEST, min(over - k, len(b1)))))

    def retarget(self, capacity: int) -> None:
        """The tier holds about ``capacity`` of this policy's keys (chunk units hold several
        slots each): ``p`` and the ghost lists are bounded by that from now on. Resident
        keys stay (the manager evicts). With the tier's slot count as ``c``, ``p`` could
        pass every resident key and ARC evicted only T2 (a hybrid replay's T2 fell to a
        fifth of the tier)."""
        self.capacity = capacity
        self.p = min(self.p, float(capacity))
        self._trim_ghosts()

    def resize(self, capacity: int) -> None:
        """A shadow's new size (nothing pinned): ``p`` clamped, T1's least recent evicted
        while |T1| > p else T2's, each to its ghost list, until ``capacity`` are left."""
        self.capacity = capacity
        self.p = min(self.p, float(capacity))
        t1, t2 = self.t1, self.t2
        while len(t1) + len(t2) > capacity:
            if t1 and (not t2 or len(t1) > self.p):
                self.b1[t1.popitem(last=False)[0]] = None
                self.n1 -= 1
            else:
                self.b2[t2.popitem(last=False)[0]] = None
                self.n2 -= 1
        self._trim_ghosts()

    def offer_one(self, key: OffloadKey) -> None:
        """``evict(n, [key])`` then ``insert([key])`` for a key not resident, with
        nothing pinned and ``n`` the one slot a full tier needs (else 0): a shadow
        tier's one-key offer, the same state changes without the per-call set-up.

        ARC's rule for one key: a ghost hit moves ``p`` (B1 up, B2 down); a full
        tier evicts T1's least recent while |T1| > p, T2's while |T1| < p, at
        |T1| == p T1's if the key is a B2 ghost (else T2's); the key joins T2 if a
        ghost remembered it (forgotten there), else T1; ghosts are trimmed."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        in1 = key in b1
        in2 = key in b2
        if in1 or in2:
            p, cap = self.p, float(self.capacity)
            if in1:
                p += max(len(b2) / len(b1), 1.0)
                if p > cap:
                    p = cap
            else:
                p -= max(len(b1) / len(b2), 1.0)
                if p < 0.0:
                    p = 0.0
            self.p = p
        if len(t1) + len(t2) >= self.capacity:
            p, n1 = self.p, self.n1
            if (t1 and (not t2 or n1 > p)) or (t1 and t2 and n1 == p and in2):
                b1[t1.popitem(last=False)[0]] = None
                self.n1 = n1 - 1
            else:
                b2[t2.popitem(last=False)[0]] = None
                self.n2 -= 1
        if in1 or in2:
            if in1:
                del b1[key]
            else:
                del b2[key]
            t2[key] = None
            self.n2 += 1
        else:
            t1[key] = None
            self.n1 += 1
        self._trim_ghosts()

    def export(self) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """The unpinned keys of T1 and of T2, each least recent first (O(n): a switch only)."""
        return list(self.t1), list(self.t2)

    def load(
        self,
        once: Iterable[OffloadKey],
        again: Iterable[OffloadKey],
        pinned: Iterable[OffloadKey],
        p: float,
    ) -> None:
        """Become T1 = ``once``, T2 = ``again`` (each least recent first) with ``pinned``
        (not in either) resident in T2, and target ``p``; forget every ghost. O(n): a switch."""
        self.__init__(self.capacity)  # type: ignore[misc]
        self.t1 = OrderedDict.fromkeys(once)
        self.t2 = OrderedDict.fromkeys(again)
        self._pinned = dict.fromkeys(pinned, T2)
        self.n1 = len(self.t1)
        self.n2 = len(self.t2) + len(self._pinned)
        self.p = max(0.0, min(float(self.capacity), p))
