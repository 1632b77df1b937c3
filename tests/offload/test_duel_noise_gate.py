"""The default's duel under chunk units: a switch needs a lead beyond the noise (issue 41).

A chunk-unit tier's request is a chain of hundreds of chunks that hit or miss
together in a shadow, so a shadow score moves in lumps of about one request's
sampled keys. ``ArmsDuel._noise`` makes a switch wait for a lead of
``noise_z`` standard deviations of the score gap, and the first-sighting verdict
is not taken; a plain tier keeps its margins and verdict.
Scripted shadows stand in for the four shadow tiers: each call's hits per arm.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.offload import OffloadKey
from kvoffload.offload.policies.default.arms_duel import ArmsDuel
from kvoffload.offload.policies.default.shadow_tier import ALL, ARC, SECOND

_CALL = [OffloadKey(bytes([i]) * 8) for i in range(2)]  # two sampled keys: ``step``


class _Scripted:
    """A shadow tier whose ``step`` returns the next scripted hit count."""

    def __init__(self, hits: list[int]) -> None:
        self.hits = iter(hits)

    def step(self, keys: Sequence[OffloadKey]) -> int:
        return next(self.hits)


def _duel(
    units: bool, script: list[tuple[int, int, int, int]], read_share: float | None = None
) -> ArmsDuel:
    """An ``ArmsDuel`` (ALL, no verdict) that scores ``script``'s calls in turn; with
    ``read_share``, that share of 1,000 first sightings' fates were reads."""
    duel = ArmsDuel(1 << 16)
    if units:
        duel.hint_units()
    if read_share is not None:
        duel._useful = round(1000 * read_share)
        duel._wasted = 1000 - duel._useful
    duel.tiers = [_Scripted([row[arm] for row in script]) for arm in range(4)]  # type: ignore[misc]
    for _ in script:
        duel._score(_CALL)
    return duel


def _lumps(calls: int) -> list[tuple[int, int, int, int]]:
    """Ties made of lumps: one request's chain hits in ALL's shadow and not in second
    sighting's, the next the other way round (ARC and BIP far behind): second sighting
    never leads."""
    return [(0, 16, 0, 0) if i % 2 else (16, 0, 0, 0) for i in range(calls)]


def test_under_chunk_units_one_lump_of_lead_does_not_switch() -> None:
    script = [*_lumps(40), (0, 16, 0, 0)]  # second sighting leads by one request
    assert _duel(units=False, script=script).mode == SECOND  # a plain tier: margin 2
    duel = _duel(units=True, script=script)
    assert duel.mode == ALL and duel.choice == ALL


def test_under_chunk_units_a_steady_lead_switches() -> None:
    script = _lumps(40) + [(8, 16, 0, 0)] * 40  # second sighting gains every request
    duel = _duel(units=True, script=script)
    assert duel.mode == SECOND


def test_under_chunk_units_arc_needs_a_lead_beyond_the_noise() -> None:
    ties = [(0, 0, 0, 16) if i % 2 else (16, 0, 0, 0) for i in range(40)]
    script = [*ties, (0, 0, 0, 16)]
    assert _duel(units=False, script=script).choice == ARC
    assert _duel(units=True, script=script).choice == ALL


def test_leaving_all_weighs_the_noise_by_the_first_sightings_read_again() -> None:
    # Second sighting gains one request's lump per call, 4 calls. Where most of ALL's
    # first sightings are read again (what a switch demotes), that is within the noise;
    # where 1 in 10 is, the gate is a fifth as high and the filter's lead is taken.
    script = _lumps(40) + [(0, 16, 0, 0)] * 4
    assert _duel(units=True, script=script, read_share=0.9).mode == ALL
    assert _duel(units=True, script=script, read_share=0.1).mode == SECOND
    assert _duel(units=False, script=script[:41], read_share=0.9).mode == SECOND


def test_under_chunk_units_the_first_sighting_verdict_is_not_taken() -> None:
    # First sightings evicted unread (the verdict), the shadows tied: a plain tier turns
    # to second sighting; a chunk-unit tier, where that share hides the continued
    # conversations' tails, follows the shadows.
    script = [(16, 16, 0, 0)] * 20  # tied
    for units, arm in ((False, SECOND), (True, ALL)):
        duel = ArmsDuel(1 << 16)
        if units:
            duel.hint_units()
        duel._first_wasted = True
        duel.tiers = [_Scripted([row[a] for row in script]) for a in range(4)]  # type: ignore[misc]
        for _ in script:
            duel._score(_CALL)
        assert duel.mode == arm


def test_back_to_all_weighs_the_noise_as_leaving_it() -> None:
    # In second sighting, ALL's shadow gains one lump per call, 4 calls: where 1 in 10 of
    # ALL's first sightings was read again, the way back is as cheap as the way out.
    script = [(16, 0, 0, 0) if i % 2 else (0, 16, 0, 0) for i in range(40)]
    script += [(16, 0, 0, 0)] * 4
    for share, arm in ((0.9, SECOND), (0.1, ALL)):
        duel = ArmsDuel(1 << 16)
        duel.hint_units()
        duel.mode = duel.choice = SECOND
        duel._useful = round(1000 * share)
        duel._wasted = 1000 - duel._useful
        duel.tiers = [_Scripted([row[a] for row in script]) for a in range(4)]  # type: ignore[misc]
        for _ in script:
            duel._score(_CALL)
        assert duel.mode == arm
