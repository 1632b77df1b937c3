"""Moved: the tiered manager is ``kvoffload.tiers.tiered_manager`` (kept for one release).

Names load on first use, so importing ``kvoffload.offload`` never imports
``kvoffload.tiers`` (which sits above it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:
    from kvoffload.tiers.tiered_manager import (
        WRITE_MODES,
        TieredOffloadingManager,
        TieredStats,
        subset_spec,
    )

__all__ = ["WRITE_MODES", "TieredOffloadingManager", "TieredStats", "subset_spec"]

__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "kvoffload.tiers.tiered_manager"))
