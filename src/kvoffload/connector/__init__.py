"""Per-step decisions: what to load on a hit, what to store and when."""

from kvoffload.connector.events import offloading_events_to_kv_events
from kvoffload.connector.lazy import LazyStoreWalker
from kvoffload.connector.metadata import ConnectorMetadata, TransferJob
from kvoffload.connector.scheduler import ConnectorStats, OffloadingConnectorScheduler
from kvoffload.connector.simple_cpu import SimpleCPUOffloadScheduler

__all__ = [
    "ConnectorMetadata",
    "ConnectorStats",
    "LazyStoreWalker",
    "OffloadingConnectorScheduler",
    "SimpleCPUOffloadScheduler",
    "TransferJob",
    "offloading_events_to_kv_events",
]
