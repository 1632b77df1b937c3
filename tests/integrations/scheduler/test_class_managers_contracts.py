"""Contracts of ``scheduler/class_managers.ClassedCPUManager`` that its docstring states.

- ``admit``: each class's answer for its own keys, in the callers' key order; a class
  that admits everything (None) counts as all True; None only when every class says so.
- A multi-class call changes each class exactly as the same call with only that class's
  keys would (checked against one plain manager per class fed the split calls).
- Hints reach every class (a class with no keys of a queued request still learns that
  it was queued and dequeued); a reset happens in every class or in none.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvoffload.integrations.vllm.scheduler.class_managers import ClassedCPUManager, key_group
from kvoffload.offload import CPUOffloadingManager, OffloadKey
from kvoffload.offload.base import make_offload_key


def key(block: int, group: int) -> OffloadKey:
    return make_offload_key(block.to_bytes(32, "big"), group)


class _Declining(CPUOffloadingManager):
    """A class whose admission declines keys of odd blocks."""

    def admit(self, keys: Sequence[OffloadKey]) -> list[bool] | None:
        return [int.from_bytes(k[:-4], "big") % 2 == 0 for k in keys]


class _Hints(CPUOffloadingManager):
    def __init__(self, n: int) -> None:
        super().__init__(n, "lru")
        self.calls: list[tuple[str, object]] = []

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        self.calls.append(("queued", (request_id, list(keys))))

    def hint_dequeued(self, request_id: str) -> None:
        self.calls.append(("dequeued", request_id))


@pytest.mark.parametrize("declining_class", [0, 1])
def test_one_classes_declines_survive_another_class_admitting_everything(
    declining_class: int,
) -> None:
    managers = [CPUOffloadingManager(8, "lru"), CPUOffloadingManager(8, "lru")]
    managers[declining_class] = _Declining(8, "lru")
    m = ClassedCPUManager(managers, [0, 1])
    assert managers[1 - declining_class].admit([key(1, 0)]) is None  # lru admits all
    keys = [key(b, g) for b in range(1, 5) for g in (0, 1)]
    flags = m.admit(keys)
    assert flags == [
        key_group(k) != declining_class or int.from_bytes(k[:-4], "big") % 2 == 0 for k in keys
    ]


def test_admit_is_none_only_when_every_class_admits_everything() -> None:
    m = ClassedCPUManager([CPUOffloadingManager(8, "lru"), CPUOffloadingManager(8, "lru")], [0, 1])
    assert m.admit([key(1, 0), key(1, 1)]) is None


def _state(m: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> tuple:
    return (
        [m.is_stored(k) for k in keys],
        [m.slot_of(k) for k in keys],
        m.num_free_blocks(),
        m.num_evictable_blocks(),
    )


def test_a_multi_class_call_changes_each_class_as_its_own_keys_alone_would() -> None:
    rng = random.Random(3)
    class_of = [0, 1, 1]
    classed = ClassedCPUManager(
        [CPUOffloadingManager(6, "lru"), CPUOffloadingManager(5, "lru")], class_of
    )
    alone = [CPUOffloadingManager(6, "lru"), CPUOffloadingManager(5, "lru")]
    universe = [key(b, g) for b in range(8) for g in range(3)]
    for _ in range(300):
        keys = list(dict.fromkeys(rng.sample(universe, rng.randint(1, 6))))
        parts = {c: [k for k in keys if class_of[key_group(k)] == c] for c in (0, 1)}
        op = rng.choice(("store", "load", "touch"))
        if op == "store":
            out = classed.prepare_store(keys)
            outs = {c: alone[c].prepare_store(ks) for c, ks in parts.items() if ks}
            if out is None:
                assert any(o is None for o in outs.values())
                for c, o in outs.items():
                    if o is not None:
                        alone[c].complete_store(parts[c], success=False)
            else:
                assert all(o is not None for o in outs.values())
                taken = {k for o in outs.values() if o for k in o.keys_to_store}
                assert set(out.keys_to_store) == taken
                assert sorted(out.evicted_keys) == sorted(
                    k for o in outs.values() if o for k in o.evicted_keys
                )
                classed.complete_store(keys)
                for c, ks in parts.items():
                    if ks:
                        alone[c].complete_store(ks)
        else:
            stored = [k for k in keys if classed.is_stored(k)]
            if op == "load" and stored:
                classed.prepare_load(stored)
                classed.complete_load(stored)
                for c in (0, 1):
                    mine = [k for k in stored if class_of[key_group(k)] == c]
                    if mine:
                        alone[c].prepare_load(mine)
                        alone[c].complete_load(mine)
            elif op == "touch":
                classed.touch(keys)
                for c, ks in parts.items():
                    if ks:
                        alone[c].touch(ks)
        for c in (0, 1):
            mine = [k for k in universe if class_of[key_group(k)] == c]
            assert _state(classed.managers[c], mine) == _state(alone[c], mine)


def test_hints_reach_every_class_and_a_reset_is_all_or_nothing() -> None:
    a, b = _Hints(4), _Hints(4)
    m = ClassedCPUManager([a, b], [0, 1])
    m.hint_queued("r1", [key(1, 0), key(2, 0)])
    m.hint_dequeued("r1")
    assert a.calls == [("queued", ("r1", [key(1, 0), key(2, 0)])), ("dequeued", "r1")]
    assert b.calls == [("queued", ("r1", [])), ("dequeued", "r1")]
    for k in (key(1, 0), key(1, 1)):
        m.complete_store(m.prepare_store([k]).keys_to_store)  # type: ignore[union-attr]
    m.prepare_load([key(1, 1)])  # class 1 has a pinned key: it cannot reset
    assert not m.can_reset_cache()
    assert m.reset_cache() is False
    assert m.is_stored(key(1, 0)) and m.is_stored(key(1, 1))
    assert m.reset_cache(force=True) is True
    assert not m.is_stored(key(1, 0)) and not m.is_stored(key(1, 1))
