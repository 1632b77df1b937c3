"""Moved: the lower-tier contract is ``kvoffload.tiers.lower_tier`` (kept for one release).

Names load on first use, so importing ``kvoffload.offload`` never imports
``kvoffload.tiers`` (which sits above it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:
    from kvoffload.tiers.lower_tier import (
        DISK_MEDIUM,
        REMOTE_MEDIUM,
        TIERED_MEDIUM,
        DiskLoadStoreSpec,
        LowerTierManager,
        RemoteLoadStoreSpec,
        TierCopy,
        TieredLoadStoreSpec,
    )

__all__ = [
    "DISK_MEDIUM",
    "REMOTE_MEDIUM",
    "TIERED_MEDIUM",
    "DiskLoadStoreSpec",
    "LowerTierManager",
    "RemoteLoadStoreSpec",
    "TierCopy",
    "TieredLoadStoreSpec",
]

__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "kvoffload.tiers.lower_tier"))
