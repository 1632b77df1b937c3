"""What the Mooncake store counts, and the alarm it raises while the store refuses puts."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvoffload.tiers import alarm
from kvoffload.tiers.alarm import FailingAlarm

logger = logging.getLogger("kvoffload.tiers.mooncake.store")


@dataclass
class MooncakeStoreStats:
    blocks_written: int = 0
    blocks_read: int = 0
    store_failures: int = 0
    misses: int = 0
    corrupt_values: int = 0
    #: Puts the store refused for want of room (no segment, or every one full).
    refused_stores: int = 0
    #: Reads whose holder did not answer (-800): removed, held absent a while.
    lost_blocks: int = 0
    upserts: int = 0
    #: Always 0 (Mooncake values have no type); named as the Redis store's stats name it.
    poisoned_keys: int = 0
    outages: int = 0
    calls_skipped: int = 0


def refusal_alarm(shown: str) -> FailingAlarm:
    return alarm.refusal_alarm(
        logger,
        "Mooncake",
        shown,
        "mount more segment memory, or lower the eviction watermark",
    )
