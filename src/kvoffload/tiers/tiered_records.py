"""What the tiered manager keeps per job in flight, and what it counts.

A load or store that involves a lower tier is recorded from its
``prepare_*`` to its ``complete_*``: which keys it pinned in which tier and
which lower-tier stores it started, so completing it settles exactly
those. ``TierKeys`` pairs a tier with the keys of one of its loads or stores.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TypeAlias

from kvoffload.offload.base import OffloadKey
from kvoffload.tiers.lower_tier import LowerTierManager

TierKeys: TypeAlias = list[tuple[LowerTierManager, list[OffloadKey]]]


@dataclass
class TieredStats:
    """Blocks loaded per medium, and the traffic between tiers.

    ``load_blocks``: handed out by ``prepare_load``; ``loaded_blocks``: of
    those, the ones whose load did not report failure (the tier hits).
    ``vanished_loads``: loads failed because a block looked up had left every
    tier by ``prepare_load`` (the engine recomputes those blocks).
    """

    load_blocks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    loaded_blocks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    promotions: int = 0
    promotions_discarded: int = 0
    promotions_failed: int = 0
    no_room_loads: int = 0
    vanished_loads: int = 0
    write_downs: int = 0
    write_throughs: int = 0


@dataclass
class PendingLoad:
    """A tiered load until its ``complete_load``: the CPU keys it pinned, the lower-tier
    keys it pinned where they are, the keys it promotes into CPU slots, the write-downs its
    promotion started, and whether it must fail (nothing pinned then)."""

    cpu_keys: list[OffloadKey]
    lower_pins: TierKeys
    promoted: list[OffloadKey]
    written: TierKeys
    error: bool = False


@dataclass
class PendingStore:
    """A tiered store until all its CPU keys completed: the lower-tier stores it started
    before (write-downs of its victims) and after (write-throughs) the GPU -> CPU copy."""

    before: TierKeys
    after: TierKeys
    # The CPU keys of the store still to complete, and whether all so far succeeded.
    waiting: set[OffloadKey] = field(default_factory=set)
    ok: bool = True
