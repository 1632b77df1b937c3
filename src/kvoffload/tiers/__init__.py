"""Everything below CPU memory: one folder per tier, and what the tiers share.

- ``disk/``: the disk tier (store, catalog, index, manifest, slabs, manager, handler, build);
- ``redis/``: the Redis / Valkey tier (store, urls, links, breaker, manager, handler, build);
- ``mooncake/``: the Mooncake Store tier (the same parts; its ``__init__`` names them);
- ``identity``: the tier fingerprint (what decides a stored block's bytes);
- ``slot_io``: CPU slots as the byte blocks the stores keep, and the handler every tier shares;
- ``alarm``: one warning when a tier's writes start failing, one when they work again;
- ``lower_tier``: the contract a lower tier implements (scheduler side) and its load / store specs;
- ``tiered_manager``: the CPU tier over the lower tiers, scheduler side;
- ``tiered_records``, ``write_down``: its jobs in flight and counters; the copies down the stack;
- ``tiered_handler``: GPU <-> CPU <-> lower-tier jobs on the worker side;
- ``config``: ``TierConfig`` (what the lower tiers take, checked once) and ``TierIdentity``;
- ``building``: what each tier's ``build.py`` takes and returns (``TierContext``, ``BuiltTier``);
- ``stack``: building the tiers behind a CPU tier (``make_tiers``).

Names are loaded lazily: ``import kvoffload.tiers`` costs nothing until a
name is used (the stack pulls in torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:
    from kvoffload.tiers.config import TierConfig, TierConfigError, TierIdentity
    from kvoffload.tiers.stack import LowerTiers, make_tiers

_LAZY = {
    "TierConfig": "kvoffload.tiers.config",
    "TierConfigError": "kvoffload.tiers.config",
    "TierIdentity": "kvoffload.tiers.config",
    "LowerTiers": "kvoffload.tiers.stack",
    "make_tiers": "kvoffload.tiers.stack",
}

__all__ = ["LowerTiers", "TierConfig", "TierConfigError", "TierIdentity", "make_tiers"]


__getattr__ = lazy_exports(__name__, _LAZY)
