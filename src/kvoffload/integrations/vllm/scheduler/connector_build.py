"""What ``KVOffloadConnector`` tells the spec that vLLM builds inside its constructor.

vLLM builds the offloading spec from its offloading config alone, deep inside
the connector's ``__init__``. Two things only ``KVOffloadConnector`` knows
reach the spec here: that it is being built under ``KVOffloadConnector`` at
all (features that need the connector's hooks are refused behind vLLM's stock
connector), and the exact kinds of the KV cache groups (the spec's config
carries only their windows; without the record the spec infers the kinds from
those). The record exists for the span of that constructor call, on the thread
making it: another engine built beside it never sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvoffload.integrations.vllm.groups.group_kinds import GroupDescription, describe_groups


@dataclass(frozen=True)
class ConnectorBuild:
    """``groups``: (group id, kind, window in tokens or None) of each offloaded group."""

    groups: tuple[GroupDescription, ...]


_local = threading.local()


@contextmanager
def connector_build(kv_cache_config: Any) -> Iterator[ConnectorBuild]:
    """The span in which ``KVOffloadConnector`` builds vLLM's connector (and so the spec)."""
    outer = current_build()
    build = ConnectorBuild(describe_groups(kv_cache_config))
    _local.build = build
    try:
        yield build
    finally:
        _local.build = outer


def current_build() -> ConnectorBuild | None:
    """The build under way on this thread, or None (vLLM's stock connector, or no build)."""
    return getattr(_local, "build", None)
