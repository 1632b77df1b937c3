"""What the scheduler side knows about a secondary tier: keys, specs, events, the manager.

No tensors here. A tier stores *offloaded blocks* named by ``OffloadKey``;
the scheduler asks the tier's ``OffloadingManager`` where a block is (a
``LoadStoreSpec`` of slot ids) and hands that spec to the worker side, which
moves the bytes.

Life of a key in a manager::

    unknown --prepare_store--> storing --complete_store(ok)--> stored
       ^                          |                              |  ^
       +--complete_store(fail)----+     prepare_load (pin, ref+1) v  | complete_load (ref-1)
       +---------------- evicted (only when stored and ref == 0) --+

Only *stored* keys count in ``lookup`` and can be loaded; a key being stored
or pinned by a load is never evicted. ``reset_cache`` takes every key back
to unknown at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from kvoffload.offload.media import CPU_MEDIUM, GPU_MEDIUM

OffloadKey = NewType("OffloadKey", bytes)

_GROUP_BYTES = 4
_MAX_GROUP = 1 << (8 * _GROUP_BYTES)


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """The key of an offloaded block: its block hash + 4-byte big-endian group index.

    The group index keeps blocks of different KV cache groups (e.g. full and
    sliding-window attention layers) that share a hash apart.
    """
    if not 0 <= group_idx < _MAX_GROUP:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_BYTES, "big"))


def _check_key(key: bytes) -> None:
    if len(key) < _GROUP_BYTES:
        raise ValueError(f"an OffloadKey has at least {_GROUP_BYTES} bytes, got {len(key)}")


def offload_key_block_hash(key: bytes) -> bytes:
    """The block hash part of ``key``."""
    _check_key(key)
    return bytes(key[:-_GROUP_BYTES])


def offload_key_group_idx(key: bytes) -> int:
    """The group index part of ``key``."""
    _check_key(key)
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


class LoadStoreSpec(ABC):
    """Where blocks are (or go) in one medium; the worker side interprets it."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name, as used in KV events ("GPU", "CPU", "DISK", ...)."""


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks named by integer ids within the medium, in transfer order.

    ``block_ids`` is a 1-D int64 numpy array (a copy when the input was not one).
    """

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: Sequence[int] | np.ndarray) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
        self.block_ids: np.ndarray = ids

    def __len__(self) -> int:
        return int(self.block_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockIDsLoadStoreSpec):
            return NotImplemented
        return self.medium() == other.medium() and np.array_equal(self.block_ids, other.block_ids)

    __hash__ = None  # type: ignore[assignment]  # mutable array inside

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU block ids (the engine's block pool)."""

    @staticmethod
    def medium() -> str:
        return GPU_MEDIUM


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slot ids in the pinned CPU block pool."""

    @staticmethod
    def medium() -> str:
        return CPU_MEDIUM


@dataclass
class PrepareStoreOutput:
    """What ``prepare_store`` decided.

    ``keys_to_store``: the requested keys the tier lacked, in request order;
    ``store_spec``: where each of them goes (same order);
    ``evicted_keys``: keys dropped to make room (the caller may write them to a
    lower tier, and must stop offering them as hits);
    ``evicted_spec``: where the evicted keys were (same order as
    ``evicted_keys``), or None when the manager does not say. Those slots are
    reused by this very store, so whoever copies evicted blocks down must do it
    before the store's transfer writes them.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]
    evicted_spec: LoadStoreSpec | None = None


@dataclass
class OffloadingEvent:
    """Keys that became stored (``removed=False``) in or were dropped from ``medium``.

    No block size: the GPU tier's events already carry it, and leaving it out
    lets one event group blocks of different sizes.
    """

    keys: list[OffloadKey]
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """The scheduler-side index of one secondary tier (or a stack of tiers).

    Keys passed in one call are in chain order (a request's blocks, head
    first) where the caller has that order; managers may use it to keep a
    chain's head longer than its tail.
    """

    @property
    @abstractmethod
    def medium(self) -> str:
        """The medium of the specs and events this manager produces."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Capacity in offloaded blocks."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Slots holding nothing (a store of this many new keys needs no eviction)."""

    @abstractmethod
    def num_evictable_blocks(self) -> int:
        """Stored keys that could be evicted right now (not pinned, not being stored)."""

    def num_room_blocks(self) -> int:
        """New keys a store could take right now: free slots plus evictable keys."""
        return self.num_free_blocks() + self.num_evictable_blocks()

    @abstractmethod
    def is_stored(self, key: OffloadKey) -> bool:
        """Whether ``key`` is stored and ready to load (a store in flight is not)."""

    @abstractmethod
    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are stored and ready to load."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        """Pin ``keys`` (all stored) against eviction until ``complete_load``; where they are."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` as just used; unknown keys are ignored."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Drop the pins ``prepare_load(keys)`` took."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Make room for the ``keys`` not stored yet; None (nothing changed) if impossible."""

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """The store of ``keys`` finished: they become loadable, or are dropped on failure.

        ``keys`` may be the very keys given to ``prepare_store``: those that
        are not being stored (already stored before, or unknown) are ignored,
        on success and on failure alike, as in vLLM 0.33. A key of ``keys``
        that another store job is writing completes too (vLLM's managers do
        the same): where stores of the same keys can overlap, pass the
        job's ``keys_to_store``, as the connectors do.
        """

    @abstractmethod
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call (none when events are disabled)."""

    # -- hints: what the engine knows about requests to come --------------------
    #
    # Hints are advice, never commands: a manager that does not use them
    # accepts and ignores them (these defaults), and no hint changes what
    # ``lookup``/``prepare_*``/``complete_*`` must do. The caller pays
    # O(keys of the request) per call; a manager must not scan its stored
    # blocks to act on one.

    def admit(self, keys: Sequence[OffloadKey]) -> list[bool] | None:
        """Which of ``keys`` (a store about to be offered, chain order) are worth storing.

        Optional and additive: ``prepare_store`` still stores every new key it
        is given. A caller that decides what to store (the connector, a replay)
        may ask first and offer only the admitted keys, so that a block the
        tier's admission filter would evict first takes no slot. One flag per
        key of ``keys``; keys already stored (or storing) are always admitted;
        a declined key is simply not stored (a later offer may admit it: being
        asked counts as a sighting). None (the default): admit every key. The
        caller should follow the answer with ``prepare_store`` of the admitted
        keys before asking again (the policy's own bookkeeping counts the
        offer once, here). Costs O(len(keys)).
        """
        return None

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        """Request ``request_id`` has arrived and waits; ``keys`` are its full blocks' keys.

        ``keys`` are in chain order (head first), stored or not: the blocks the
        request will look up when it is scheduled. A policy may protect and
        prefer them while the request waits. Announcing a request that is
        already queued replaces its keys (a preempted request comes back with
        more blocks). Ended by ``hint_dequeued(request_id)``.
        """
        return None

    def hint_dequeued(self, request_id: str) -> None:
        """Request ``request_id`` left the queue: scheduled, aborted or finished.

        Its queue hint no longer holds. A request that was never announced, or
        was already dequeued, is ignored (callers may dequeue on every exit).
        """
        return None

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        """A finished request's conversation will continue: ``keys`` will likely be read again.

        A soft priority (a client's session hint, not a queued request):
        there is no matching "dequeue", and a policy may let it fade.
        ``keys`` are in chain order.
        """
        return None

    def can_reset_cache(self) -> bool:
        """Whether ``reset_cache()`` would succeed now: no key pinned or being stored."""
        return False

    def reset_cache(self, force: bool = False) -> bool:
        """Forget every block of the tier; False (nothing changed) while any is busy.

        Busy: pinned by a load or being stored. The forgotten stored keys are
        announced in one ``removed`` event of the tier's medium (none when it
        held nothing). Events queued before the reset stay queued, ahead of it.

        ``force=True`` is vLLM 0.33's reset: it clears busy keys too and
        always succeeds. The caller then guarantees what vLLM's scheduler
        does: no ``complete_load``/``complete_store`` for a job prepared
        before the reset, and no transfer of such a job still running once a
        new job reuses the tier's slots.
        """
        raise NotImplementedError(f"{type(self).__name__} has no reset_cache")


def release_pins(refs: dict[OffloadKey, int], keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """Drop one load pin per occurrence of each key in ``refs``; the keys left unpinned.

    Checks first, so a bad call changes nothing: every key must hold at least
    as many pins as it occurs in ``keys``. A key's count is removed from
    ``refs`` when it reaches 0 (``refs`` holds only counts > 0); the keys
    that reached 0 are returned in ``keys`` order.
    """
    for key, n in Counter(keys).items():
        if refs.get(key, 0) < n:
            raise ValueError(f"complete_load of key {key.hex()} that is not pinned that often")
    unpinned: list[OffloadKey] = []
    for key in keys:
        r = refs[key] - 1
        if r == 0:
            del refs[key]
            unpinned.append(key)
        else:
            refs[key] = r
    return unpinned


def finish_stores(storing: set[OffloadKey], keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """End the in-flight stores among ``keys``; those keys, deduplicated, in order.

    Keys that are not in ``storing`` (already stored, or unknown) are ignored:
    ``complete_store`` accepts the very keys given to ``prepare_store``.
    """
    done = [k for k in dict.fromkeys(keys) if k in storing]
    storing.difference_update(done)
    return done


def reassign_slots(
    slot_of: dict[OffloadKey, int],
    free: list[int],
    victims: Sequence[OffloadKey],
    new: Sequence[OffloadKey],
) -> tuple[list[int], list[int]]:
    """Move ``victims``' slots to ``free``, then give each of ``new`` a free slot.

    Keeps the slots of ``slot_of`` and ``free`` disjoint; ``free`` must then
    hold at least ``len(new)`` slots. Returns (the new keys' slots, the
    victims' slots), each in key order; ``free`` is popped from its end.
    The new keys take the popped slots in ascending order: the slots freed
    together (one earlier store's, evicted together) are consecutive, and a
    job whose slots run upwards in key order is a few slice copies where the
    engine's block ids run upwards too (``transfer.copy_plan``), not one copy
    per block.
    """
    victim_slots = list(map(slot_of.pop, victims))
    free.extend(victim_slots)
    cut = len(free) - len(new)
    if cut < 0:
        raise ValueError(f"{len(new)} new keys but only {len(free)} free slots")
    # The slots free.pop() would give, without a Python loop per key.
    slots = sorted(free[cut:])
    del free[cut:]
    slot_of.update(zip(new, slots))
    return slots, victim_slots
