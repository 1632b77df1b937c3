"""kvoffload's per-tier Prometheus metrics inside vLLM's offloading metrics.

vLLM builds them from ``metric_definitions`` (a spec's or a tier's
``build_metric_definitions``) next to its own ``vllm:kv_offload_tiering_*``
and labels each with the tier (``TIER_LABEL``: "<index + 1>:<type>").
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

#: vLLM's label name for a tier (``tiering.base.TIER_LABEL``, spelled out: 0.32 lacks the name).
TIER_LABEL = "tier"

#: kvoffload's per-tier metrics, beyond vLLM's generic ``vllm:kv_offload_tiering_*``. Named
#: under ``vllm:`` because a new engine's stat logger unregisters exactly those collectors:
#: any other prefix survives, and a second engine in the process fails on registering it again.
CHECKSUM_FAILURES = "vllm:kvoffload_tier_checksum_failures"
BLOCKS_LOST = "vllm:kvoffload_tier_blocks_lost"
EVICTIONS = "vllm:kvoffload_tier_evictions"
STORES_DROPPED = "vllm:kvoffload_tier_stores_dropped"
WRITE_ERRORS = "vllm:kvoffload_tier_write_errors"
BYTES_IN_USE = "vllm:kvoffload_tier_bytes_in_use"
CAPACITY_BYTES = "vllm:kvoffload_tier_capacity_bytes"
AVAILABLE = "vllm:kvoffload_tier_available"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Prometheus definitions of kvoffload's tier metrics (labelled by vLLM's tier label)."""
    labels = (TIER_LABEL,)

    def counter(doc: str) -> OffloadingCounterMetadata:
        return OffloadingCounterMetadata(documentation=doc, labelnames=labels)

    def gauge(doc: str) -> OffloadingGaugeMetadata:
        return OffloadingGaugeMetadata(documentation=doc, labelnames=labels)

    return {
        CHECKSUM_FAILURES: counter(
            "Blocks a kvoffload tier read back whose checksum (or length) was wrong: "
            "dropped and reported as failed promotion keys, never served."
        ),
        BLOCKS_LOST: counter(
            "Blocks a promotion asked a kvoffload tier for that it no longer held "
            "(evicted by the server, dropped as corrupt, tier unreachable)."
        ),
        EVICTIONS: counter("Blocks a kvoffload tier evicted to stay within its budget."),
        STORES_DROPPED: counter(
            "Blocks a kvoffload tier did not store: tier unreachable, no evictable room, "
            "or the store refused them."
        ),
        WRITE_ERRORS: counter("Blocks whose write to a kvoffload tier failed (I/O error)."),
        BYTES_IN_USE: gauge("Bytes of KV a kvoffload tier holds (stored blocks)."),
        CAPACITY_BYTES: gauge("A kvoffload tier's budget in bytes (0: the server's memory)."),
        AVAILABLE: gauge("1 while a kvoffload tier is reachable, 0 during an outage."),
    }
