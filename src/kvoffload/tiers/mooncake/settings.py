"""The Mooncake tier's ``TierConfig`` keys, checked (``TierConfig`` calls ``check``).

Keys: ``mooncake_url`` (``mooncakestore://HOST:PORT``, the master),
``mooncake_namespace`` (prefixes every object; default "kvoffload"),
``mooncake_metadata`` (``P2PHANDSHAKE``, or an ``http://`` / ``etcd://``
metadata server), ``mooncake_protocol`` (``tcp`` or ``rdma``),
``mooncake_segment_bytes`` (memory this process contributes to the pool; 0:
a pure client of other holders) and ``mooncake_local_buffer_bytes`` (the
client's own transfer buffer). Sizes take integers or strings such as
"4GiB". The Mooncake and Redis tiers are both the shared remote tier: one
engine uses one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvoffload.tiers.config import MOONCAKE_KEYS, TierConfig
from kvoffload.tiers.mooncake.client import (
    SCHEME,
    check_metadata,
    check_protocol,
    parse_master_url,
)

#: The keys ``check`` reads (``TierConfig``'s own list of them).
KEYS: tuple[str, ...] = MOONCAKE_KEYS
#: What ``check`` fills in for a key not given: ``TierConfig``'s defaults (no URL).
DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(TierConfig)
    if f.name in KEYS and f.name != "mooncake_url"
}


class MooncakeSettingError(ValueError):
    """A bad Mooncake key: ``key`` and the one-line reason."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(why)
        self.key = key
        self.why = why


def _size(key: str, value: Any) -> int:
    from kvoffload.transfer.sizing import parse_bytes

    if isinstance(value, bool):
        raise MooncakeSettingError(key, f"expected a size in bytes, got {value!r}")
    try:
        n = parse_bytes(value) if value not in (0, "0") else 0
    except (ValueError, TypeError) as exc:
        raise MooncakeSettingError(key, str(exc)) from None
    if n < 0:
        raise MooncakeSettingError(key, f"must be >= 0, got {value!r}")
    return n


def check(values: Mapping[str, Any]) -> dict[str, Any]:
    """The Mooncake keys of ``values`` normalised; a bad one is a ``MooncakeSettingError``."""
    out = {**DEFAULTS, **{k: v for k, v in values.items() if k in KEYS}}
    url = out.get("mooncake_url")
    if url is not None:
        try:
            out["mooncake_url"] = f"{SCHEME}://{parse_master_url(url).addr}"
        except ValueError as exc:
            raise MooncakeSettingError("mooncake_url", str(exc)) from None
    ns = out["mooncake_namespace"]
    if not isinstance(ns, str) or not ns or "/" in ns:
        raise MooncakeSettingError(
            "mooncake_namespace", f"expected a non-empty string without '/', got {ns!r}"
        )
    for key, fn in (("mooncake_metadata", check_metadata), ("mooncake_protocol", check_protocol)):
        try:
            out[key] = fn(out[key])
        except ValueError as exc:
            raise MooncakeSettingError(key, str(exc)) from None
    for key in ("mooncake_segment_bytes", "mooncake_local_buffer_bytes"):
        out[key] = _size(key, out[key])
    return out
