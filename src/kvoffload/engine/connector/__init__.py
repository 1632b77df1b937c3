"""Per-step decisions: what to load on a hit, what to store and when."""

from kvoffload.engine.connector.events import offloading_events_to_kv_events
from kvoffload.engine.connector.lazy import LazyStoreWalker
from kvoffload.engine.connector.metadata import ConnectorMetadata, TransferJob
from kvoffload.engine.connector.scheduler import ConnectorStats, OffloadingConnectorScheduler
from kvoffload.engine.connector.simple_cpu import SimpleCPUOffloadScheduler

__all__ = [
    "ConnectorMetadata",
    "ConnectorStats",
    "LazyStoreWalker",
    "OffloadingConnectorScheduler",
    "SimpleCPUOffloadScheduler",
    "TransferJob",
    "offloading_events_to_kv_events",
]
