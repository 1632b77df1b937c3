"""The interface every cache policy of a tier implements.

A policy only orders keys; the manager owns slots, ref counts and events.
The manager guarantees, and a policy may rely on:

- ``insert(keys)``: each key is new to the policy (not resident) and unpinned;
  the keys are one store's, in chain order (head first);
- ``access(keys)``: each key is resident (it may be pinned);
- ``pin(keys)``: each key is resident and unpinned; afterwards it is no
  eviction candidate until ``unpin``. A key is pinned once however many loads
  hold it (the manager counts references);
- ``unpin(keys)``: each key is pinned;
- ``evict(n, incoming)``: called once per store that brings new keys, with
  ``0 <= n <= num_evictable()``; returns ``n`` distinct unpinned resident keys
  and forgets them (ghost lists may remember them). ``incoming`` are the keys
  about to be inserted (policies with ghost lists adapt to them here; the
  store may still fail, in which case they are never inserted).

Every operation is O(1) amortised per key: no scan over the resident keys.
The resident count never exceeds ``capacity`` (the manager has that many
slots).

Chains: a lookup only counts a chain's leading stored blocks, so a chain's
head is worth at least as much as its tail (every request that reaches a block
also reads all blocks before it). Policies therefore take the keys of one call
tail first (``chain_order``) so that the head ends up the most recently used
and a chain is evicted from its tail. ``hint_parent`` tells a policy where a
stored chain is about to be continued by a store (see ``chain_lru``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from kvoffload.offload.base import OffloadKey


class CachePolicy(ABC):
    """Eviction order over the resident keys of one tier of ``capacity`` slots."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity

    def clear(self) -> None:
        """Forget every key, ghost and adaptive state, as when new (the tier was reset).

        The default rebuilds the policy empty through ``__init__(capacity)``:
        cheap (no per-key work), and right for any policy whose state is all
        set up there. The caller must hold no pins (the manager resets only then).
        """
        type(self).__init__(self, self.capacity)

    @staticmethod
    def chain_order(keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        """The order in which one call's keys are applied: tail first, head last."""
        return keys[::-1]

    def hint_parent(self, child: OffloadKey, parent: OffloadKey) -> None:
        """``parent`` precedes ``child`` in a chain and is stored; ``child`` may come next.

        Optional (the default ignores it). The manager gives it where it sees a
        chain continue past the stored blocks: the first miss after a lookup's
        hits, and the first new key after stored ones in a store.
        """
        return None

    def hint_units(self) -> None:
        """The keys this policy ranks are chunk units, each of one to several slots.

        Called by the chunk-unit layer (``kvoffload.offload.chunk_units``) when it
        wraps this policy, and again after each ``clear``: a full tier then holds
        fewer of this policy's keys than ``capacity`` (which counts slots). A policy
        that decides by its free room or sizes anything by ``capacity`` should go by
        what it holds when full instead. Never called for a tier of one group; the
        default ignores it.
        """
        return None

    # Queue and session hints. The manager forwards what the engine knows about
    # requests that have arrived but not run. Contract for every policy:
    # - each hint costs O(keys of the request) (``hint_dequeued``: O(keys given
    #   to the matching ``hint_queued``); no hint scans the stored blocks;
    # - keys in hints may be resident, absent or never stored; a hint never
    #   inserts, evicts or pins anything by itself and never changes what the
    #   manager may evict (``num_evictable`` counts hinted keys as evictable);
    # - hints are soft: a policy that ignores them (the defaults below) is correct.

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        """Request ``request_id`` has arrived and waits; ``keys`` are its full-block keys.

        A policy may protect and prefer these keys until ``hint_dequeued``.
        Queued again under the same id replaces the earlier keys. Cost
        O(len(keys)); the default ignores it.
        """
        return None

    def hint_dequeued(self, request_id: str) -> None:
        """Request ``request_id`` was scheduled, aborted or finished: its hint ends.

        Releases what ``hint_queued`` protected for it; an unknown id is
        ignored. Cost O(keys of that request); the default ignores it.
        """
        return None

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        """Session hint: the conversation whose blocks are ``keys`` will continue.

        A soft priority (a later turn is expected to read these keys again),
        weaker than a queued request's claim and never a pin. Cost
        O(len(keys)); the default ignores it.
        """
        return None

    def admit(self, keys: Sequence[OffloadKey], in_flight: int = 0) -> list[bool] | None:
        """Which of ``keys`` (new to the tier, offered for one store, chain order) to store.

        Asked by the manager before the store is prepared (``OffloadingManager.admit``);
        the caller then offers only the admitted keys, so a declined key takes no
        slot. Deciding counts as seeing the offer (a policy updates its sighting
        history, shadows and duel here exactly as its ``evict`` would have), and
        the ``evict`` of the store that follows does not count the admitted keys
        again. ``in_flight``: slots the manager holds for stores not yet
        completed (the policy does not see them). None (the default): store all.
        """
        return None

    @abstractmethod
    def __len__(self) -> int:
        """Resident keys (pinned included)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""

    @abstractmethod
    def num_evictable(self) -> int:
        """Resident keys that are not pinned."""

    def room(self, in_flight: int = 0) -> int:
        """Slots a store could get now: free ones (less ``in_flight`` stores' keys, which
        hold slots but are not resident yet) and evictable keys."""
        return self.capacity - len(self) - in_flight + self.num_evictable()

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def access(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def pin(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def unpin(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]: ...
