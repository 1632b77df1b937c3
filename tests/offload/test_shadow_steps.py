"""The shadow tiers' unrolled one-key step is their general step on a one-key call.

``ShadowTier.one(key)`` (and ``ArcArm.offer_one`` under it) exist only for speed:
every hit count and every bit of state (orders included) must be what
``step([key])`` gives, on random calls mixed with multi-key ones.
"""

from __future__ import annotations

import random

import pytest

from kvoffload.offload.policies.default.shadow_tier import ALL, ARC, BIP, SECOND, ShadowTier


def _state(t: ShadowTier) -> tuple[object, ...]:
    if t.arc is not None:
        a = t.arc
        return (list(a.t1), list(a.t2), list(a.b1), list(a.b2), a.p, a.n1, a.n2, t.broken)
    return (list(t.lru), list(t.rejects), list(t.seen), t.stores, t.broken)


@pytest.mark.parametrize("mode", [ALL, SECOND, BIP, ARC])
def test_one_key_step_equals_general_step(mode: int) -> None:
    for seed in range(60):
        rnd = random.Random(seed)
        cap = rnd.choice([1, 2, 3, 5, 8, 16])
        universe = [bytes([i]) * 8 for i in range(rnd.choice([4, 10, 30, 60]))]
        history, period = rnd.choice([2, 5, 50]), rnd.choice([1, 2, 4])
        general = ShadowTier(cap, mode, history, period)
        unrolled = ShadowTier(cap, mode, history, period)
        for _ in range(200):
            if rnd.random() < 0.2:  # a new request
                general.broken = unrolled.broken = False
            if rnd.random() < 0.6:
                k = rnd.choice(universe)
                assert general.step([k]) == unrolled.one(k)
            else:
                ks = rnd.sample(universe, rnd.randint(1, min(6, len(universe))))
                assert general.step(ks) == unrolled.step(ks)
            assert _state(general) == _state(unrolled)
