"""The CPU tier of several slot classes: one kvoffload ``CPUOffloadingManager`` per class.

Groups whose slots differ in size (``group_slots``) cannot share one slot-id
space without padding every slot to the largest, so each slot class has its
own manager (its own slots, policy and room) and its own host pool on the
workers. ``ClassedCPUManager`` routes every key by its group index (the last
four bytes of an ``OffloadKey``) to its class's manager and merges the
answers, keeping the callers' key order: the slot ids of a spec are local to
each key's class, which is how the worker reads them (it knows each group's
class from the same plan).

Invariants: a key lives only in its class's manager; a multi-class call
changes each class exactly as the same call with only that class's keys
would; a ``prepare_store`` that one class refuses (``None``) leaves none of
its keys storing in any class (the classes that accepted are rolled back
with ``complete_store(success=False)``; what they evicted stays evicted).

Within a class the chunk-as-unit policy sees every group of the class; a
chunk's keys in different classes are kept or dropped by their own classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import takewhile
from typing import Any

from kvoffload.offload import CPULoadStoreSpec, CPUOffloadingManager, OffloadKey
from kvoffload.offload.base import OffloadingEvent, PrepareStoreOutput


def key_group(key: OffloadKey) -> int:
    """The KV cache group index packed into an ``OffloadKey`` (vLLM's encoding)."""
    return int.from_bytes(key[-4:], "big")


class ClassedCPUManager:
    """``CPUOffloadingManager``'s methods over one manager per slot class.

    ``managers[c]`` holds the keys of the groups ``g`` with ``class_of[g] == c``
    (``class_of`` indexed by the group index in the keys). An unknown group
    index is a ``ValueError``.
    """

    def __init__(self, managers: Sequence[CPUOffloadingManager], class_of: Sequence[int]) -> None:
        if not managers:
            raise ValueError("ClassedCPUManager needs at least one manager")
        self.managers = list(managers)
        self.class_of = tuple(class_of)

    def _cls(self, key: OffloadKey) -> int:
        g = key_group(key)
        if g >= len(self.class_of):
            n = len(self.class_of)
            raise ValueError(f"offload key of KV cache group {g}; the tier has {n} groups")
        return self.class_of[g]

    def manager_of(self, key: OffloadKey) -> CPUOffloadingManager:
        return self.managers[self._cls(key)]

    def _split(self, keys: Sequence[OffloadKey]) -> dict[int, list[OffloadKey]]:
        out: dict[int, list[OffloadKey]] = {}
        for key in keys:
            out.setdefault(self._cls(key), []).append(key)
        return out

    def _sum(self, name: str) -> int:
        return sum(int(getattr(m, name)()) for m in self.managers)

    # -- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    def num_free_blocks(self) -> int:
        return self._sum("num_free_blocks")

    def num_evictable_blocks(self) -> int:
        return self._sum("num_evictable_blocks")

    def num_stored_blocks(self) -> int:
        return self._sum("num_stored_blocks")

    def num_room_blocks(self) -> int:
        return self._sum("num_room_blocks")

    # -- lookups and loads ---------------------------------------------------------------

    def is_stored(self, key: OffloadKey) -> bool:
        return self.manager_of(key).is_stored(key)

    def is_storing(self, key: OffloadKey) -> bool:
        return self.manager_of(key).is_storing(key)

    def slot_of(self, key: OffloadKey) -> int | None:
        return self.manager_of(key).slot_of(key)

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        return sum(1 for _ in takewhile(self.is_stored, keys))

    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        parts = self._split(keys)
        specs = {c: self.managers[c].prepare_load(ks) for c, ks in parts.items()}
        return CPULoadStoreSpec(_merge(keys, self._cls, {c: s.block_ids for c, s in specs.items()}))

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        for c, ks in self._split(keys).items():
            self.managers[c].complete_load(ks)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for c, ks in self._split(keys).items():
            self.managers[c].touch(ks)

    # -- stores --------------------------------------------------------------------------

    def admit(self, keys: Sequence[OffloadKey]) -> list[bool] | None:
        parts = self._split(keys)
        flags: dict[int, list[bool] | None] = {
            c: self.managers[c].admit(ks) for c, ks in parts.items()
        }
        if all(f is None for f in flags.values()):
            return None
        taken = {c: iter(f if f is not None else [True] * len(parts[c])) for c, f in flags.items()}
        return [next(taken[self._cls(k)]) for k in keys]

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        parts = self._split(list(dict.fromkeys(keys)))
        outs: dict[int, PrepareStoreOutput] = {}
        for c, ks in parts.items():
            out = self.managers[c].prepare_store(ks)
            if out is None:
                for done in outs:
                    self.managers[done].complete_store(parts[done], success=False)
                return None
            outs[c] = out
        stored = {c: set(o.keys_to_store) for c, o in outs.items()}
        slots_by = {c: o.store_spec.block_ids for c, o in outs.items()}  # type: ignore[attr-defined]
        order = [k for k in dict.fromkeys(keys) if k in stored.get(self._cls(k), ())]
        evicted = [k for o in outs.values() for k in o.evicted_keys]
        spec = CPULoadStoreSpec(_merge(order, self._cls, slots_by))
        return PrepareStoreOutput(order, spec, evicted)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        for c, ks in self._split(keys).items():
            self.managers[c].complete_store(ks, success=success)

    # -- hints, events, reset ------------------------------------------------------------

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        parts = self._split(keys)
        for c, m in enumerate(self.managers):
            m.hint_queued(request_id, parts.get(c, []))

    def hint_dequeued(self, request_id: str) -> None:
        for m in self.managers:
            m.hint_dequeued(request_id)

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        for c, ks in self._split(keys).items():
            self.managers[c].hint_continues(ks)

    def can_reset_cache(self) -> bool:
        return all(m.can_reset_cache() for m in self.managers)

    def reset_cache(self, force: bool = False) -> bool:
        if not force and not self.can_reset_cache():
            return False
        for m in self.managers:
            m.reset_cache(force=force)
        return True

    def take_events(self) -> list[OffloadingEvent]:
        return [ev for m in self.managers for ev in m.take_events()]


def _merge(
    keys: Sequence[OffloadKey], cls_of: Callable[[OffloadKey], int], slots_by: dict[int, Any]
) -> list[int]:
    """Each key's class-local slot, in ``keys`` order (each class's slots come in its key order)."""
    its = {c: iter(int(s) for s in slots) for c, slots in slots_by.items()}
    return [next(its[cls_of(k)]) for k in keys]
