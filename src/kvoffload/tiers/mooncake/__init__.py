"""The Mooncake Store tier: a fleet's shared KV in the store Mooncake serves it from.

``client`` is the typed adapter over the wheel's ``MooncakeDistributedStore``
(and the ``mooncakestore://`` URL); ``store`` keeps one checksummed object per
block under a namespace derived from the tier fingerprint, zero-copy from
and into registered memory; ``probe`` the breaker that stops calls while the
master or a holder is gone; ``presence`` learns what the master lists off
the scheduler thread; ``manager`` is the scheduler-side view; ``handler``
moves bytes between the CPU tier's slots and the store. Nothing here imports
the wheel until a client is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:
    from kvoffload.tiers.mooncake.client import (
        MasterAddress,
        MooncakeUnavailable,
        parse_master_url,
    )
    from kvoffload.tiers.mooncake.handler import MooncakeTransferHandler
    from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager
    from kvoffload.tiers.mooncake.store import MooncakeBlockStore, MooncakeStoreStats

_LAZY = {
    "MasterAddress": "kvoffload.tiers.mooncake.client",
    "MooncakeUnavailable": "kvoffload.tiers.mooncake.client",
    "parse_master_url": "kvoffload.tiers.mooncake.client",
    "MooncakeTransferHandler": "kvoffload.tiers.mooncake.handler",
    "MooncakeOffloadingManager": "kvoffload.tiers.mooncake.manager",
    "MooncakeBlockStore": "kvoffload.tiers.mooncake.store",
    "MooncakeStoreStats": "kvoffload.tiers.mooncake.store",
}

__all__ = [
    "MasterAddress",
    "MooncakeBlockStore",
    "MooncakeOffloadingManager",
    "MooncakeStoreStats",
    "MooncakeTransferHandler",
    "MooncakeUnavailable",
    "parse_master_url",
]

__getattr__ = lazy_exports(__name__, _LAZY)
