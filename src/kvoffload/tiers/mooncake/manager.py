"""The Mooncake tier's manager: the master is the truth, asked off the scheduler thread.

Like the Redis tier (``kvoffload.tiers.redis.manager``, whose manager this
one is), other engines store into the same namespace and the store evicts
on its own, so nothing is indexed locally: presence is asked through a
``PresenceCache`` over ``MooncakeBlockStore.contains_many`` (never on the
scheduler thread), stores in flight are not loadable, and a block found
missing (evicted by the pool, lost with a master's restart or a holder's
death) is a clean miss whose announcement is withdrawn.

Events: stores are announced on the ``REMOTE`` medium (vLLM 0.33's
``STORAGE`` with locality ``REMOTE``) once they landed, with the store's
``ownership`` (``mooncake:<namespace>:<digest>``), so a router unions what
every instance naming the same store announced. What the store evicted on
its own is withdrawn as soon as this instance asks about it and hears
"absent"; keys this instance remembers are bounded (``max_announced``).
"""

from __future__ import annotations

from kvoffload.tiers.mooncake.presence import make_presence
from kvoffload.tiers.mooncake.store import MooncakeBlockStore
from kvoffload.tiers.redis.manager import RemoteOffloadingManager


class MooncakeOffloadingManager(RemoteOffloadingManager):
    """The scheduler side of a ``MooncakeBlockStore`` (presence always asynchronous).

    The manager owns the presence thread; ``close`` stops it (not the store).
    """

    def __init__(
        self,
        store: MooncakeBlockStore,
        enable_events: bool = False,
        max_announced: int = 1 << 16,
    ) -> None:
        super().__init__(
            store.contains_many,
            lambda: store.available,
            enable_events,
            max_announced=max_announced,
            presence=make_presence(store.contains_many),
            ownership=store.ownership,
        )
        self.store = store
