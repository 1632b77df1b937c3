"""The keys of a kvoffload tier's ``secondary_tiers`` entry, checked once at start-up."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload.base import Locality

from kvoffload.tiers.config import TIER_KEYS, TierConfig, TierConfigError

#: Keys every kvoffload tier takes besides its ``TierConfig`` keys (see each tier's docstring).
COMMON_KEYS: tuple[str, ...] = ("locality", "enable_kv_events", "model_revision")


def split_keys(
    tier_type: str,
    keys: Mapping[str, Any],
    tier_keys: Sequence[str],
    own_keys: Sequence[str],
) -> tuple[TierConfig, dict[str, Any]]:
    """``keys`` checked once: the ``TierConfig`` they describe and this tier's own keys.

    ``tier_keys``: the ``TierConfig`` keys this tier takes; ``own_keys``: its
    other keys. Any other key, a ``TierConfig`` key of the other tier, a bad
    value or write-back is a ``TierConfigError`` (one line naming the key).
    """
    where = f"secondary_tiers[{tier_type}]"
    allowed = [*tier_keys, "write_mode", "write_through", *own_keys]
    for key in keys:
        if key not in allowed:
            other = key in TIER_KEYS
            why = (
                "belongs to the other kvoffload tier (give each tier its own entry)"
                if other
                else f"unknown key; {tier_type} takes {', '.join(sorted(allowed))}"
            )
            raise TierConfigError(f"{where}[{key!r}]: {why}")
    tier = {k: v for k, v in keys.items() if k in tier_keys or k in ("write_mode", "write_through")}
    if "enable_kv_events" in keys:
        if "enable_events" in keys:
            raise TierConfigError(
                f"{where}['enable_kv_events']: give it or enable_events, not both"
            )
        tier["enable_events"] = keys["enable_kv_events"]
    config = TierConfig.from_mapping(tier, where=where)
    if config is None:
        need = next(k for k in ("disk_dir", "redis_url", "mooncake_url") if k in tier_keys)
        raise TierConfigError(f"{where}[{need!r}]: missing")
    if config.write_mode != "write_through" and ("write_mode" in keys or "write_through" in keys):
        key = "write_mode" if "write_mode" in keys else "write_through"
        raise TierConfigError(
            f"{where}[{key!r}]: vLLM's tiering writes every block to every tier as it "
            "reaches the CPU tier (write-through); write-back needs the CPU tier's "
            "evictions, which vLLM does not give secondary tiers"
        )
    own = {k: v for k, v in keys.items() if k in own_keys}
    if "locality" in own:
        value = own["locality"]
        try:
            own["locality"] = Locality(str(value).upper())
        except ValueError:
            raise TierConfigError(
                f"{where}['locality']: expected LOCAL or REMOTE, got {value!r}"
            ) from None
    if "model_revision" in own:
        rev = own["model_revision"]
        if not isinstance(rev, str) or not rev.strip():
            raise TierConfigError(f"{where}['model_revision']: expected a non-empty string")
    return config, own
