"""``KVOffloadMooncakeTier``: kvoffload's Mooncake Store tier as a vLLM secondary tier.

In vLLM's ``TieringOffloadingSpec``::

    "secondary_tiers": [{"type": "KVOffloadMooncakeTier",
                         "module_path": "kvoffload.integrations.vllm",
                         "mooncake_url": "mooncakestore://master:50051"}]

Keys (checked once at start-up through ``TierConfig``; a bad or unknown key
is one ``TierConfigError`` line naming it): ``mooncake_url`` (required),
``mooncake_namespace``, ``mooncake_metadata``, ``mooncake_protocol``,
``mooncake_segment_bytes``, ``mooncake_local_buffer_bytes`` (as
``kvoffload.tiers.mooncake.settings`` describes them), ``num_threads`` (4),
``enable_events`` / ``enable_kv_events``, ``probe_interval_s`` (the
breaker's probe period, 0.25), and the common ``locality`` /
``model_revision``; ``write_mode`` only "write_through".

Everything else is the Redis tier's (``KVOffloadRedisTier``, whose class
this one extends): presence asked in one batch per scheduler step off the
scheduler thread (``RETRY`` until answered), stores and loads on I/O
threads, ``STORAGE`` events with locality ``REMOTE`` and the store's
ownership (``mooncake:<namespace>:<digest>``), and vLLM's metrics under this
tier's label, its hits counted where vLLM's categories put a remote store.
What differs: vLLM's shared CPU region is registered with the Mooncake
client once, and each block moves straight between its row and the store
(a header from a registered array of one header per row): no staging copy.
The breaker is the store's (``kvoffload.tiers.mooncake.probe``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.tiers.base import logger
from kvoffload.integrations.vllm.tiers.io_threads import IOJob
from kvoffload.integrations.vllm.tiers.keys import COMMON_KEYS
from kvoffload.integrations.vllm.tiers.redis import KVOffloadRedisTier, _seconds
from kvoffload.tiers.config import TierConfig, TierConfigError
from kvoffload.tiers.identity import parse_fingerprint
from kvoffload.tiers.mooncake.build import open_store
from kvoffload.tiers.mooncake.client import MooncakeUnavailable
from kvoffload.tiers.mooncake.probe import PROBE_INTERVAL_S
from kvoffload.tiers.mooncake.settings import KEYS as MOONCAKE_KEYS
from kvoffload.tiers.mooncake.store import HEADER_BYTES

MOONCAKE_TIER_KEYS: tuple[str, ...] = (*MOONCAKE_KEYS, "num_threads", "enable_events")
MOONCAKE_OWN_KEYS: tuple[str, ...] = (*COMMON_KEYS, "probe_interval_s")


class KVOffloadMooncakeTier(KVOffloadRedisTier):
    """kvoffload's Mooncake tier under vLLM's tiering manager (module docstring for the keys)."""

    #: vLLM derives a tier's hit source from its medium unless the class names one: a
    #: Mooncake Store is a remote store ("external_unspecified"), as the Redis tier says.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    TIER_KEYS: ClassVar[tuple[str, ...]] = MOONCAKE_TIER_KEYS
    OWN_KEYS: ClassVar[tuple[str, ...]] = MOONCAKE_OWN_KEYS

    def _open_store(self, where: str, config: TierConfig, own: Mapping[str, Any]) -> None:
        probe_s = _seconds(where, "probe_interval_s", own.get("probe_interval_s", PROBE_INTERVAL_S))
        try:
            self.mc = open_store(
                config,
                self.row_bytes,
                self.identity,
                parse_fingerprint(self.identity).get("hash_fn", ""),
                probe_interval_s=max(probe_s, 1e-3),
            )
            # The Redis tier's code reads ``store``; this tier's own code reads ``mc``.
            self.store = self.mc  # type: ignore[assignment]
            self._register_rows()
        except (ValueError, MooncakeUnavailable) as exc:
            # The shared constructor closes the store if it was opened.
            raise TierConfigError(f"{where}['mooncake_url']: {exc}") from None
        self._watch_store(self.mc.ownership)
        logger.info(
            "kvoffload Mooncake tier %s: %s, namespace %s (prefix %s), %s bytes contributed",
            self.label,
            self.mc.shown_url,
            config.mooncake_namespace,
            self.mc.prefix,
            config.mooncake_segment_bytes,
        )

    def _register_rows(self) -> None:
        """vLLM's rows and one header per row, registered once: blocks move in place."""
        rows = self._rows
        assert rows is not None
        self._headers = np.zeros((max(1, rows.shape[0]), HEADER_BYTES), dtype=np.uint8)
        if rows.size:
            self.mc.register(rows.ctypes.data, rows.nbytes)
        self.mc.register(self._headers.ctypes.data, self._headers.nbytes)

    def _run_io(self, job: IOJob) -> Sequence[bool]:
        rows = self.rows(job.chunks)
        headers = [self._headers[c] for c in job.chunks]
        try:
            if job.is_load:
                return self.mc.get_views(job.keys, rows, headers)
            return self.mc.put_views(job.keys, rows, headers)
        except Exception as exc:
            # Only the message leaves this frame: a kept traceback would hold views of
            # vLLM's shared region, which vLLM then could not unmap at shutdown.
            why = str(exc)
        logger.warning("kvoffload Mooncake tier %s: I/O failed: %s", self.label, why)
        return [False] * len(job.keys)
