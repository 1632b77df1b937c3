"""The tiers' names ("media") as specs, jobs and KV events carry them, defined once.

The values are the KV-event medium strings (``kvoffload.events.types``), so
a spec's ``medium()`` is also what its tier's events say. ``TIERED_MEDIUM``
names a job that spans tiers (a load promoting disk or Redis blocks through
CPU slots); it never appears in events. Consumers that publish vLLM 0.33's
profile map ``DISK`` / ``REMOTE`` to ``STORAGE`` with a locality (the
connector's event conversion).
"""

from __future__ import annotations

from kvoffload.events.types import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_REMOTE

GPU_MEDIUM = MEDIUM_GPU
CPU_MEDIUM = MEDIUM_CPU
DISK_MEDIUM = MEDIUM_DISK
REMOTE_MEDIUM = MEDIUM_REMOTE
TIERED_MEDIUM = "TIERED"

__all__ = ["CPU_MEDIUM", "DISK_MEDIUM", "GPU_MEDIUM", "REMOTE_MEDIUM", "TIERED_MEDIUM"]
