"""DiskOffloadingManager: slots, LRU eviction, pins, restore after restart, drops, events."""

from __future__ import annotations

import pytest

from kvoffload.offload import OffloadingEvent, OffloadKey
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.lower_tier import DiskLoadStoreSpec
from tests.offload.keyutil import key, keys


def stored(m: DiskOffloadingManager, *ids: int) -> None:
    out = m.prepare_store(keys(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)


def test_store_then_load_gives_disk_slots_and_keys() -> None:
    m = DiskOffloadingManager(4)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    assert isinstance(out.store_spec, DiskLoadStoreSpec)
    assert out.store_spec.block_ids.tolist() == [0, 1]
    assert out.store_spec.keys == keys(1, 2)
    assert m.lookup(keys(1, 2)) == 0  # not loadable while storing
    m.complete_store(keys(1, 2))
    assert m.lookup(keys(1, 2, 3)) == 2
    spec = m.prepare_load(keys(2, 1))
    assert spec == DiskLoadStoreSpec([1, 0], keys(2, 1))
    assert spec.medium() == "DISK"
    m.complete_load(keys(2, 1))


def test_lru_eviction_tail_first_and_victim_spec() -> None:
    m = DiskOffloadingManager(3)
    stored(m, 1, 2, 3)  # one chain: 3 is its tail, evicted first
    out = m.prepare_store(keys(9))
    assert out is not None
    assert out.evicted_keys == keys(3)
    assert out.evicted_spec == DiskLoadStoreSpec([2], keys(3))
    assert out.store_spec.block_ids.tolist() == [2]  # type: ignore[attr-defined]
    m.complete_store(keys(9))
    m.touch(keys(1))  # 2 is now the least recently used
    out = m.prepare_store(keys(10))
    assert out is not None and out.evicted_keys == keys(2)


def test_pinned_and_storing_keys_are_never_evicted() -> None:
    m = DiskOffloadingManager(2)
    stored(m, 1, 2)
    m.prepare_load(keys(1, 2))
    assert m.prepare_store(keys(5)) is None
    m.complete_load(keys(1))
    out = m.prepare_store(keys(5))
    assert out is not None and out.evicted_keys == keys(1)
    assert m.prepare_store(keys(6)) is None  # 2 pinned, 5 storing
    m.complete_load(keys(2))


def test_store_keeps_stored_keys_of_the_same_call() -> None:
    m = DiskOffloadingManager(2)
    stored(m, 1, 2)
    out = m.prepare_store(keys(1, 7))
    assert out is not None
    assert out.keys_to_store == keys(7) and out.evicted_keys == keys(2)


def test_failed_store_frees_the_slots() -> None:
    m = DiskOffloadingManager(2)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    m.complete_store(keys(1, 2), success=False)
    assert m.num_free_blocks() == 2 and m.lookup(keys(1)) == 0


def test_misuse_is_an_error() -> None:
    m = DiskOffloadingManager(2)
    with pytest.raises(ValueError, match="not stored"):
        m.prepare_load(keys(1))
    m.complete_store(keys(1))  # not being stored: ignored, as vLLM 0.33 does
    assert m.num_free_blocks() == 2
    with pytest.raises(ValueError, match="not pinned"):
        m.complete_load(keys(1))
    with pytest.raises(ValueError, match="positive"):
        DiskOffloadingManager(0)


def test_restore_entries_after_a_restart() -> None:
    m = DiskOffloadingManager(4, enable_events=True, restored=[(key(5), 3), (key(6), 0)])
    assert m.lookup(keys(5, 6)) == 2
    assert m.prepare_load(keys(5)).block_ids.tolist() == [3]
    m.complete_load(keys(5))
    assert m.take_events() == [OffloadingEvent(keys(5, 6), "DISK", removed=False)]
    out = m.prepare_store(keys(1, 2))
    assert out is not None and sorted(out.store_spec.block_ids.tolist()) == [1, 2]  # type: ignore[attr-defined]
    m.complete_store(keys(1, 2))
    out = m.prepare_store(keys(3))
    assert out is not None and out.evicted_keys == keys(6)  # the oldest restored entry


@pytest.mark.parametrize(
    "restored", [[(key(1), 4)], [(key(1), 0), (key(2), 0)], [(key(1), 0), (key(1), 1)]]
)
def test_bad_restore_entries(restored: list[tuple[bytes, int]]) -> None:
    with pytest.raises(ValueError):
        DiskOffloadingManager(4, restored=restored)  # type: ignore[arg-type]


def test_drop_unpinned_now_pinned_later() -> None:
    m = DiskOffloadingManager(3, enable_events=True)
    stored(m, 1, 2)
    m.take_events()
    m.prepare_load(keys(2))
    m.drop(keys(1, 2, 99))
    assert m.lookup(keys(1)) == 0 and not m.is_stored(key(2))
    assert m.take_events() == [OffloadingEvent(keys(1), "DISK", removed=True)]
    assert m.num_free_blocks() == 2
    m.complete_load(keys(2))
    assert m.take_events() == [OffloadingEvent(keys(2), "DISK", removed=True)]
    assert m.num_free_blocks() == 3


def test_events_in_order() -> None:
    m = DiskOffloadingManager(1, enable_events=True)
    stored(m, 1)
    stored(m, 2)
    assert m.take_events() == [
        OffloadingEvent(keys(1), "DISK", removed=False),
        OffloadingEvent(keys(1), "DISK", removed=True),
        OffloadingEvent(keys(2), "DISK", removed=False),
    ]
    assert m.take_events() == []
    quiet = DiskOffloadingManager(1)
    stored(quiet, 1)
    assert quiet.take_events() == []


def test_complete_store_accepts_the_keys_given_to_prepare_store() -> None:
    m = DiskOffloadingManager(4, enable_events=True)
    stored(m, 1)
    m.take_events()
    out = m.prepare_store(keys(1, 2))
    assert out is not None and out.keys_to_store == keys(2)
    m.complete_store(keys(1, 2))
    assert m.lookup(keys(1, 2)) == 2
    assert m.take_events() == [OffloadingEvent(keys(2), "DISK", removed=False)]
    m.prepare_store(keys(1, 3))
    m.complete_store(keys(1, 3), success=False)
    assert m.lookup(keys(1)) == 1 and m.slot_of(key(3)) is None and m.num_free_blocks() == 2


def test_reset_cache_clears_the_store_too_and_refuses_while_busy() -> None:
    cleared: list[bool] = []
    m = DiskOffloadingManager(
        3, enable_events=True, restored=[(key(7), 2)], clear_store=lambda: cleared.append(True)
    )
    stored(m, 1)
    m.take_events()
    m.prepare_load(keys(7))
    assert m.reset_cache() is False and cleared == [] and m.lookup(keys(7, 1)) == 2
    m.drop(keys(7))  # doomed while pinned: still announced until unpinned
    m.complete_load(keys(7))
    m.take_events()
    stored(m, 7)
    m.prepare_store(keys(2))
    assert m.reset_cache() is False and cleared == []
    m.complete_store(keys(2))
    m.take_events()
    assert m.reset_cache() is True and cleared == [True]
    (ev,) = m.take_events()
    assert ev.removed and ev.medium == "DISK" and sorted(ev.keys) == sorted(keys(1, 2, 7))
    assert m.lookup(keys(1)) == 0 and m.num_free_blocks() == 3 and m.num_stored_blocks() == 0


def test_forced_reset_drops_busy_keys() -> None:
    m = DiskOffloadingManager(2, enable_events=True)
    stored(m, 1)
    m.prepare_load(keys(1))
    m.prepare_store(keys(2))
    assert m.reset_cache(force=True) is True
    assert m.num_free_blocks() == 2 and m.ref_count(key(1)) == 0
    m.complete_store(keys(2))  # stale: ignored
    assert m.lookup(keys(2)) == 0


def test_reset_with_a_real_disk_store_survives_a_restart(tmp_path) -> None:
    """Wired to ``DiskBlockStore.clear``: a re-opened store restores nothing from before."""
    import numpy as np

    from kvoffload.tiers.disk.store import DiskBlockStore

    def open_store() -> DiskBlockStore:
        return DiskBlockStore(tmp_path, 4096, 4, "geom=test", hash_fn="sha256")

    store = open_store()
    m = DiskOffloadingManager(4, restored=[], clear_store=store.clear)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    data = np.ones((2, 4096), dtype=np.uint8)
    assert store.put(out.keys_to_store, data, out.store_spec.block_ids.tolist()) == [True, True]  # type: ignore[attr-defined]
    m.complete_store(out.keys_to_store)
    store.close()
    store = open_store()
    assert len(store.entries()) == 2  # what a restart would restore before the reset
    m = DiskOffloadingManager(
        4, restored=[(OffloadKey(e.key), e.slot) for e in store.entries()], clear_store=store.clear
    )
    assert m.lookup(keys(1, 2)) == 2
    assert m.reset_cache() is True
    store.close()
    store = open_store()
    assert store.entries() == []
    store.close()
