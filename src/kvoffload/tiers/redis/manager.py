"""The remote tier's manager: a shared server holds the blocks; the server is the truth.

Other engines store into the same namespace and the server evicts on its own
(max-memory, TTL), so a local index would be stale by design. Instead
presence questions go to the server through ``exists_fn`` (one pipelined
round trip per call, answered at once with "absent" during an outage):
synchronously without ``presence``, or, with a ``PresenceCache``, off the
scheduler thread: lookups answer at once from what is known (a block
another engine stored is served a step later), and a stale "present" ends
in a failed load that the engine recomputes. Locally there are only the
in-flight stores (not loadable yet) and load pins (kept for the contract:
the server may still evict a pinned block, in which case the load fails and
the engine recomputes).

Events: a successful store is announced (``REMOTE``) once; a key this
manager announced and later finds missing is announced as removed. Announced
keys are remembered up to ``max_announced`` (least recently stored forgotten
first, and announced as removed when forgotten), so the stream is the set of
keys this instance vouches for (``kvoffload.events``); with
``max_announced=0`` nothing is announced. Events carry ``event_ownership``
(the namespace): a router unions the sets of every instance that names the
same one, since any of them can load what another stored.

Reset: the namespace is shared by every engine with the same tier
fingerprint (model, KV geometry, hash function and seed, ...), so
``reset_cache`` deletes nothing on the server: other instances may be
reading those blocks, and they are still right for this fingerprint. It
forgets what this instance knows (its announcements, announced as removed,
so routers stop sending prefixes here for them). A change that makes the
stored KV wrong (new weights) must change the fingerprint, which moves the
engine to a fresh namespace; deleting a whole namespace on purpose is
``RedisBlockStore.clear()``, an operator's decision.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvoffload.offload.base import (
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    finish_stores,
    release_pins,
)
from kvoffload.tiers.lower_tier import REMOTE_MEDIUM, LowerTierManager, RemoteLoadStoreSpec
from kvoffload.tiers.redis.presence import PresenceCache

ExistsFn = Callable[[Sequence[bytes]], list[bool]]
AvailableFn = Callable[[], bool]

#: Nominal capacity: the server's memory, not known here.
UNBOUNDED_BLOCKS = 1 << 40


class RemoteOffloadingManager(LowerTierManager):
    """Presence by asking the server; stores never evict (the server does).

    ``exists_fn(keys)``: whether each key is on the server now
    (``RedisBlockStore.contains_many``). ``available_fn()``: False during an
    outage (``RedisBlockStore.available``); stores are then skipped
    (``keys_to_store`` empty) instead of queued to fail. ``presence``: ask
    off the caller's thread instead (module docstring); the manager owns it
    and ``close`` stops it. ``ownership``: the shared tier's id that its KV
    events carry (``RedisBlockStore.ownership``), so a router can index a
    block announced by any instance as loadable by every instance that
    announces the same id.
    """

    answers_locally = False

    def __init__(
        self,
        exists_fn: ExistsFn,
        available_fn: AvailableFn | None = None,
        enable_events: bool = False,
        max_announced: int = 1 << 16,
        presence: PresenceCache | None = None,
        ownership: str | None = None,
    ) -> None:
        if max_announced < 0:
            raise ValueError(f"max_announced must be >= 0, got {max_announced}")
        self._exists = exists_fn
        self._available = available_fn
        self.presence = presence
        self.enable_events = enable_events
        #: The shared tier's id in KV events (``RedisBlockStore.ownership``).
        self.event_ownership = ownership
        self.max_announced = max_announced
        self._storing: set[OffloadKey] = set()
        self._refs: dict[OffloadKey, int] = {}
        self._announced: OrderedDict[OffloadKey, None] = OrderedDict()
        self._events: list[OffloadingEvent] = []

    @property
    def medium(self) -> str:
        return REMOTE_MEDIUM

    @property
    def num_blocks(self) -> int:
        return UNBOUNDED_BLOCKS

    def num_free_blocks(self) -> int:
        return UNBOUNDED_BLOCKS

    def num_evictable_blocks(self) -> int:
        return 0

    def ref_count(self, key: OffloadKey) -> int:
        return self._refs.get(key, 0)

    # -- presence -----------------------------------------------------------

    def _ask(self, keys: list[OffloadKey]) -> tuple[list[bool], list[OffloadKey]]:
        """Per key, present now; and the keys the server was seen without."""
        if not keys:
            return [], []
        if self.presence is None:
            there = self._exists(keys)
            return there, [k for k, t in zip(keys, there) if not t]
        known = self.presence.known(keys)
        return [v is True for v in known], [k for k, v in zip(keys, known) if v is False]

    def stored_mask(self, keys: Sequence[OffloadKey]) -> list[bool]:
        keys = list(keys)
        ask = [k for k in keys if k not in self._storing]
        there, absent = self._ask(ask)
        answers = dict(zip(ask, there))
        mask = [answers.get(k, False) for k in keys]
        gone = [k for k in dict.fromkeys(absent) if k in self._announced]
        if gone:
            for k in gone:
                del self._announced[k]
            if self.enable_events:
                self._events.append(OffloadingEvent(gone, REMOTE_MEDIUM, removed=True))
        return mask

    def awaiting(self, key: OffloadKey) -> bool:
        """Whether presence of ``key`` is still being asked (a lookup could hit next step)."""
        if self.presence is None or key in self._storing:
            return False
        return self.presence.unanswered([key])[0]

    def wait_answers(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the presence probes queued or in flight."""
        if self.presence is None:
            return True
        return self.presence.wait_idle(timeout_s)

    def is_stored(self, key: OffloadKey) -> bool:
        return self.stored_mask([key])[0]

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        n = 0
        for there in self.stored_mask(keys):
            if not there:
                break
            n += 1
        return n

    # -- loads --------------------------------------------------------------

    def prepare_load(self, keys: Sequence[OffloadKey]) -> RemoteLoadStoreSpec:
        keys = list(keys)
        for key in keys:
            if key in self._storing:
                raise ValueError(f"cannot load key {key.hex()} from remote: store in flight")
        for key in keys:
            self._refs[key] = self._refs.get(key, 0) + 1
        return RemoteLoadStoreSpec(keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        release_pins(self._refs, list(keys))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Nothing: the server refreshes a block's TTL when it is read."""

    # -- stores -------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput:
        unique = [k for k in dict.fromkeys(keys) if k not in self._storing]
        # Asking first also probes a server thought down, so stores alone recover the tier
        # (with ``presence`` the probe runs on its thread; unknown keys are stored again).
        there = self._ask(unique)[0]
        if self._available is not None and not self._available():
            there = [True] * len(unique)
        new = [k for k, t in zip(unique, there) if not t]
        self._storing.update(new)
        return PrepareStoreOutput(new, RemoteLoadStoreSpec(new), [], RemoteLoadStoreSpec([]))

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        keys = finish_stores(self._storing, keys)
        if not keys:
            return
        if not success:
            return
        if self.presence is not None:
            self.presence.mark(keys, True)
        if not self.max_announced:
            return  # nothing remembered, nothing announced: a store without its removal lies
        ann = self._announced
        new: list[OffloadKey] = []
        for k in keys:
            if k not in ann:
                new.append(k)
            ann[k] = None
            ann.move_to_end(k)
        forgotten: list[OffloadKey] = []
        while len(ann) > self.max_announced:
            forgotten.append(ann.popitem(last=False)[0])
        if self.enable_events:
            # Each announced key is announced once, and withdrawn when it is
            # forgotten: a router's set never keeps a key nobody vouches for.
            if forgotten:
                self._events.append(OffloadingEvent(forgotten, REMOTE_MEDIUM, removed=True))
            new = [k for k in new if k in ann]
            if new:
                self._events.append(OffloadingEvent(new, REMOTE_MEDIUM, removed=False))

    def drop(self, keys: Sequence[OffloadKey]) -> None:
        """Forget announcements only: the server is shared, and the store already
        deletes values that fail verification."""
        if self.presence is not None:
            self.presence.mark(keys, False)
        gone = [k for k in dict.fromkeys(keys) if k in self._announced]
        for k in gone:
            del self._announced[k]
        if gone and self.enable_events:
            self._events.append(OffloadingEvent(gone, REMOTE_MEDIUM, removed=True))

    def can_reset_cache(self) -> bool:
        return not self._storing and not self._refs

    def reset_cache(self, force: bool = False) -> bool:
        """Forget local knowledge only; the shared server keeps its blocks (module docstring)."""
        if not force and not self.can_reset_cache():
            return False
        announced = list(self._announced)
        self._announced.clear()
        if self.presence is not None:
            self.presence.forget()
        self._storing.clear()
        self._refs.clear()
        if announced and self.enable_events:
            self._events.append(OffloadingEvent(announced, REMOTE_MEDIUM, removed=True))
        return True

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        """A waiting request's keys: learn whether the server has them before it is scheduled."""
        if self.presence is not None:
            self.presence.prefetch(k for k in keys if k not in self._storing)

    def close(self) -> None:
        """Stop the presence thread (if any); answers then come from what was known."""
        if self.presence is not None:
            self.presence.close()

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events
