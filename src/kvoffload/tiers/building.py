"""What a tier's builder takes and returns (``kvoffload.tiers.stack`` runs the builders).

Each tier folder has a ``build.py`` with one function ``build_<tier>(ctx:
TierContext) -> BuiltTier | None``: None when the configuration does not ask
for that tier; otherwise it opens the tier's store (configuration errors
raise here, before the engine serves) and builds its manager and handler
over it with ``BuiltTier.over``, which closes what was already built when a
later part fails. ``stack.TIER_BUILDERS`` lists the builders in stacking
order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvoffload.tiers.config import TierConfig, TierIdentity
from kvoffload.tiers.lower_tier import LowerTierManager
from kvoffload.tiers.slot_io import SlotTierHandler
from kvoffload.transfer.host_pool import HostPool


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class TierContext:
    """What every tier builder takes: the configuration and the CPU tier's facts."""

    config: TierConfig
    identity: TierIdentity
    host_pool: HostPool
    #: The tiers' fingerprint (``identity.tier_fingerprint``).
    fingerprint: str

    @property
    def slot_bytes(self) -> int:
        return self.host_pool.slot_bytes


@dataclass
class BuiltTier:
    """One lower tier, both sides: its manager, its handler, and the store they share."""

    manager: LowerTierManager
    handler: SlotTierHandler
    store: Closable

    @classmethod
    def over(
        cls,
        store: Closable,
        manager: Callable[[], LowerTierManager],
        handler: Callable[[], SlotTierHandler],
    ) -> BuiltTier:
        """The tier over an open ``store``; if ``manager()`` or ``handler()`` fails, what
        was built (the manager, then the store) is closed and the error propagates."""
        built: LowerTierManager | None = None
        try:
            built = manager()
            return cls(built, handler(), store)
        except BaseException:
            if built is not None:
                built.close()
            store.close()
            raise

    def close(self) -> None:
        """Manager (background threads) first, then the handler's jobs, then the store."""
        self.manager.close()
        self.handler.close()
        self.store.close()
