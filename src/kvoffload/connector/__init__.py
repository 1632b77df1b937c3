"""Moved: the reference engine's connector is ``kvoffload.engine.connector``.

This package keeps its public names importable (loaded on first use); new code
imports them from ``kvoffload.engine.connector``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:
    from kvoffload.engine.connector import (
        ConnectorMetadata,
        ConnectorStats,
        LazyStoreWalker,
        OffloadingConnectorScheduler,
        SimpleCPUOffloadScheduler,
        TransferJob,
        offloading_events_to_kv_events,
    )

__all__ = [
    "ConnectorMetadata",
    "ConnectorStats",
    "LazyStoreWalker",
    "OffloadingConnectorScheduler",
    "SimpleCPUOffloadScheduler",
    "TransferJob",
    "offloading_events_to_kv_events",
]

__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "kvoffload.engine.connector"))
