"""TieredOffloadingManager: lookups across tiers, promotions, write-back and write-through."""

from __future__ import annotations

import pytest

from kvoffload.offload import CPULoadStoreSpec, CPUOffloadingManager, GPULoadStoreSpec, OffloadKey
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.lower_tier import (
    DiskLoadStoreSpec,
    RemoteLoadStoreSpec,
    TierCopy,
    TieredLoadStoreSpec,
)
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.tiered_manager import TieredOffloadingManager, subset_spec
from tests.offload.keyutil import key, keys
from tests.tiers.tier_world import World


def make(
    cpu_blocks: int = 2,
    disk_blocks: int | None = 4,
    remote: bool = False,
    mode: str = "write_back",
) -> tuple[World, TieredOffloadingManager]:
    w = World()
    lower = []
    if disk_blocks is not None:
        lower.append(DiskOffloadingManager(disk_blocks, enable_events=True))
    if remote:
        lower.append(RemoteOffloadingManager(w.exists, w.available, enable_events=True))
    cpu = CPUOffloadingManager(cpu_blocks, "lru", enable_events=True)
    return w, TieredOffloadingManager(cpu, lower, write_mode=mode)


def store(w: World, m: TieredOffloadingManager, ids: list[int], ok: bool = True) -> None:
    ks = keys(*ids)
    out = m.prepare_store(ks)
    assert out is not None
    gpu = GPULoadStoreSpec(list(range(1000, 1000 + len(out.keys_to_store))))
    for b, k in zip(gpu.block_ids.tolist(), out.keys_to_store):
        w.gpu[b] = bytes(k)
    success = w.run(gpu, out.store_spec) and ok
    m.complete_store(out.keys_to_store, success)


def load(
    w: World, m: TieredOffloadingManager, ids: list[int], report: bool = True
) -> tuple[int, bool]:
    ks = keys(*ids)
    n = m.lookup(ks)
    if n == 0:
        return 0, False
    spec = m.prepare_load(ks[:n])
    gpu = GPULoadStoreSpec(list(range(n)))
    ok = w.run(spec, gpu)
    if ok:
        assert w.read(gpu) == [bytes(k) for k in ks[:n]]
    m.complete_load(ks[:n], success=ok if report else None)
    return n, ok


def media(m: TieredOffloadingManager) -> list[tuple[str, bool, list[OffloadKey]]]:
    return [(e.medium, e.removed, e.keys) for e in m.take_events()]


# -- construction ---------------------------------------------------------------


def test_bad_configuration() -> None:
    cpu = CPUOffloadingManager(2)
    with pytest.raises(ValueError, match="write_mode"):
        TieredOffloadingManager(cpu, [], write_mode="sometimes")
    d = DiskOffloadingManager(2)
    with pytest.raises(ValueError, match="distinct media"):
        TieredOffloadingManager(cpu, [d, DiskOffloadingManager(2)])


def test_room_figures_are_the_cpu_tier_s() -> None:
    _, m = make(cpu_blocks=3)
    assert m.medium == "CPU" and m.num_blocks == 3
    assert m.num_free_blocks() == 3 and m.num_evictable_blocks() == 0


# -- CPU-only paths stay plain ---------------------------------------------------


def test_cpu_hits_load_with_a_plain_cpu_spec() -> None:
    w, m = make(cpu_blocks=4)
    store(w, m, [1, 2])
    assert m.lookup(keys(1, 2, 3)) == 2
    spec = m.prepare_load(keys(1, 2))
    assert isinstance(spec, CPULoadStoreSpec)
    m.complete_load(keys(1, 2))
    assert m.stats.load_blocks["CPU"] == 2


def test_store_without_eviction_is_plain() -> None:
    _, m = make(cpu_blocks=4)
    out = m.prepare_store(keys(1, 2))
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)


# -- write-back and promotion ----------------------------------------------------


def test_cpu_victims_are_written_back_to_disk_before_their_slots_are_reused() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    out = m.prepare_store(keys(3))
    assert out is not None and out.evicted_keys == keys(2)  # the chain's tail
    spec = out.store_spec
    assert isinstance(spec, TieredLoadStoreSpec) and spec.after == ()
    (copy,) = spec.before
    assert copy.required is False
    assert copy.src == CPULoadStoreSpec(out.evicted_spec.block_ids)  # type: ignore[union-attr]
    assert isinstance(copy.dst, DiskLoadStoreSpec) and copy.dst.keys == keys(2)
    assert spec.cpu.block_ids.tolist() == copy.src.block_ids.tolist()  # type: ignore[attr-defined]
    w.gpu[7] = bytes(key(3))
    assert w.run(GPULoadStoreSpec([7]), spec)
    m.complete_store(keys(3))
    assert m.tier_of(keys(1, 2, 3)) == ["CPU", "DISK", "CPU"]
    assert ("DISK", False, keys(2)) in media(m)


def test_disk_hit_is_promoted_then_loaded() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    store(w, m, [3])  # 2 goes down to disk
    assert m.lookup(keys(1, 2)) == 2
    spec = m.prepare_load(keys(1, 2))
    assert isinstance(spec, TieredLoadStoreSpec)
    promos = [c for c in spec.before if c.required]
    assert len(promos) == 1 and promos[0].src.medium() == "DISK" and promos[0].dst.medium() == "CPU"
    gpu = GPULoadStoreSpec([0, 1])
    assert w.run(spec, gpu)
    assert w.read(gpu) == [bytes(k) for k in keys(1, 2)]
    m.complete_load(keys(1, 2), success=True)
    assert m.tier_of(keys(1, 2)) == ["CPU", "CPU"]  # promoted
    assert m.stats.load_blocks["DISK"] == 1 and m.stats.promotions == 1
    # The promotion evicted 3 from CPU (1 was pinned): 3 went down to disk.
    assert m.tier_of(keys(3)) == ["DISK"]


def test_promotion_without_an_outcome_is_discarded() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    store(w, m, [3])
    n, ok = load(w, m, [1, 2], report=False)
    assert (n, ok) == (2, True)
    assert m.tier_of(keys(2)) == ["DISK"]  # not trusted into CPU, still on disk
    assert m.stats.promotions_discarded == 1
    assert load(w, m, [1, 2]) == (2, True)  # and it loads again fine


def test_failed_promotion_drops_the_lower_copy() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    store(w, m, [3])
    slot = m.lower[0].slot_of(key(2))  # type: ignore[attr-defined]
    w.disk[slot] = (bytes(key(2)), b"rotten")
    assert load(w, m, [1, 2]) == (2, False)
    assert m.tier_of(keys(2)) == [None]
    assert m.lookup(keys(1, 2)) == 1
    assert ("DISK", True, keys(2)) in media(m)


def test_lookup_stops_where_no_tier_has_the_key() -> None:
    w, m = make(cpu_blocks=2, remote=True)
    store(w, m, [1, 2])
    store(w, m, [3])  # 2 -> disk
    w.remote[bytes(key(5))] = bytes(key(5))
    assert m.tier_of(keys(1, 2, 4, 5)) == ["CPU", "DISK", None, "REMOTE"]
    assert m.lookup(keys(1, 2, 4, 5)) == 2


def test_lookup_is_limited_by_promotion_room() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=4)
    for i in (1, 2, 3):
        store(w, m, [i])  # 1 and 2 end on disk, 3 in CPU
    assert m.tier_of(keys(1, 2)) == ["DISK", "DISK"]
    # One CPU slot: only one block can be promoted by one load.
    assert m.lookup(keys(1, 2)) == 1
    m.prepare_load(keys(3))
    assert m.lookup(keys(1)) == 0  # the only CPU slot is pinned
    m.complete_load(keys(3))
    assert m.lookup(keys(1)) == 1


def test_no_room_load_fails_cleanly() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=4)
    store(w, m, [1])
    store(w, m, [2])  # 1 -> disk
    m.prepare_load(keys(2))  # pins the only CPU slot
    spec = m.prepare_load(keys(1))  # a caller that skipped lookup
    assert isinstance(spec, TieredLoadStoreSpec) and spec.error
    assert not w.run(spec, GPULoadStoreSpec([0]))
    m.complete_load(keys(1), success=False)
    m.complete_load(keys(2))
    assert m.tier_of(keys(1)) == ["DISK"]  # nothing was read: nothing dropped
    assert m.stats.no_room_loads == 1 and m.num_in_flight() == 0
    # A key no tier has (evicted since lookup) is a failed load, not an error.
    gone = m.prepare_load(keys(99))
    assert isinstance(gone, TieredLoadStoreSpec) and "left every tier" in (gone.error or "")
    m.complete_load(keys(99), success=False)
    assert m.stats.vanished_loads == 1 and m.num_in_flight() == 0


def test_storing_keys_are_not_loaded_nor_promoted() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    store(w, m, [3])  # 2 -> disk
    spec = m.prepare_load(keys(2))  # promotion in flight: 2 is storing in CPU
    assert m.lookup(keys(2)) == 0
    assert w.run(spec, GPULoadStoreSpec([0]))
    m.complete_load(keys(2), success=True)
    assert m.lookup(keys(2)) == 1


def test_disk_victims_cascade_to_remote_first() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=1, remote=True)
    store(w, m, [1])
    store(w, m, [2])  # 1 -> disk
    out = m.prepare_store(keys(3))  # 2 -> disk, so 1 -> remote first
    assert out is not None
    spec = out.store_spec
    assert isinstance(spec, TieredLoadStoreSpec)
    assert [(c.src.medium(), c.dst.medium()) for c in spec.before] == [
        ("DISK", "REMOTE"),
        ("CPU", "DISK"),
    ]
    w.gpu[0] = bytes(key(3))
    assert w.run(GPULoadStoreSpec([0]), spec)
    m.complete_store(keys(3))
    assert m.tier_of(keys(1, 2, 3)) == ["REMOTE", "DISK", "CPU"]
    assert load(w, m, [1]) == (1, True)  # from the remote, through a CPU slot
    assert m.stats.load_blocks["REMOTE"] == 1


def test_remote_only_tier_behind_cpu() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=None, remote=True)
    store(w, m, [1])
    store(w, m, [2])  # 1 -> remote
    assert bytes(key(1)) in w.remote
    assert load(w, m, [1]) == (1, True)


def test_remote_outage_means_misses_and_skipped_write_downs() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=None, remote=True)
    store(w, m, [1])
    store(w, m, [2])  # 1 -> remote
    w.remote_up = False
    assert m.lookup(keys(1)) == 0
    store(w, m, [3])  # 2 would go down: skipped, no failing job queued
    assert bytes(key(2)) not in w.remote
    w.remote_up = True
    assert load(w, m, [1]) == (1, True)


def test_write_through_writes_every_store_to_every_tier() -> None:
    w, m = make(cpu_blocks=2, disk_blocks=4, remote=True, mode="write_through")
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    spec = out.store_spec
    assert isinstance(spec, TieredLoadStoreSpec) and spec.before == ()
    assert [(c.src.medium(), c.dst.medium()) for c in spec.after] == [
        ("CPU", "DISK"),
        ("CPU", "REMOTE"),
    ]
    for b, k in enumerate(keys(1, 2)):
        w.gpu[b] = bytes(k)
    assert w.run(GPULoadStoreSpec([0, 1]), spec)
    m.complete_store(keys(1, 2))
    assert m.lower[0].lookup(keys(1, 2)) == 2 and m.lower[1].lookup(keys(1, 2)) == 2
    store(w, m, [3, 4])  # 1, 2 evicted from CPU: no write-back needed
    assert m.tier_of(keys(1, 2, 3)) == ["DISK", "DISK", "CPU"]
    ev = media(m)
    assert ("REMOTE", False, keys(1, 2)) in ev and ("CPU", True, keys(2, 1)) in ev


def test_failed_store_in_write_through_leaves_lower_tiers_empty() -> None:
    w, m = make(cpu_blocks=2, disk_blocks=4, mode="write_through")
    store(w, m, [1], ok=False)
    assert m.tier_of(keys(1)) == [None]
    assert m.num_in_flight() == 0


def test_events_carry_each_tier_s_medium() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=1, remote=True)
    store(w, m, [1])
    store(w, m, [2])
    store(w, m, [3])
    ev = media(m)
    assert ("CPU", False, keys(1)) in ev
    assert ("CPU", True, keys(1)) in ev
    assert ("DISK", False, keys(1)) in ev
    assert ("DISK", True, keys(1)) in ev
    assert ("REMOTE", False, keys(1)) in ev


def test_touch_reaches_every_tier() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=2)
    store(w, m, [1])
    store(w, m, [2])
    store(w, m, [3])  # disk: 1, 2
    m.touch(keys(1))  # 2 is now the disk's LRU
    store(w, m, [4])  # 3 -> disk, evicting 2
    assert m.tier_of(keys(1, 2)) == ["DISK", None]


def test_is_stored_checks_local_tiers_only() -> None:
    w, m = make(cpu_blocks=1, disk_blocks=1, remote=True)
    store(w, m, [1])
    store(w, m, [2])
    store(w, m, [3])  # 1 -> remote, 2 -> disk
    assert m.is_stored(key(3)) and m.is_stored(key(2))
    assert not m.is_stored(key(1))


def test_subset_spec() -> None:
    ks = keys(1, 2, 3)
    assert subset_spec(CPULoadStoreSpec([7, 8, 9]), ks, keys(3, 1)) == CPULoadStoreSpec([9, 7])
    d = subset_spec(DiskLoadStoreSpec([4, 5, 6], ks), ks, keys(2))
    assert d == DiskLoadStoreSpec([5], keys(2))
    assert subset_spec(RemoteLoadStoreSpec(ks), ks, keys(2)) == RemoteLoadStoreSpec(keys(2))
    with pytest.raises(TypeError):
        subset_spec(TieredLoadStoreSpec(CPULoadStoreSpec([])), ks, [])


def test_tier_copy_and_spec_reprs() -> None:
    spec = TieredLoadStoreSpec(
        CPULoadStoreSpec([1]),
        [TierCopy(DiskLoadStoreSpec([0], keys(1)), CPULoadStoreSpec([1]), True)],
    )
    assert spec.medium() == "TIERED" and len(spec) == 1
    assert "DISK->CPUx1!" in repr(spec)


def test_hit_counts_per_tier_exclude_failed_loads() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    store(w, m, [3])  # 2 -> disk
    assert load(w, m, [1, 2]) == (2, True)
    assert m.hit_blocks_by_medium() == {"CPU": 1, "DISK": 1}
    assert m.lower_hit_blocks == 1
    w.fail_next = [("CPU", "GPU")]
    assert load(w, m, [1]) == (1, False)
    assert m.hit_blocks_by_medium() == {"CPU": 1, "DISK": 1}
    assert m.stats.load_blocks["CPU"] == 2


# -- vLLM 0.33 contract points -------------------------------------------------------


def test_complete_store_with_the_given_keys_settles_the_write_back() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    out = m.prepare_store(keys(1, 3))  # 1 is stored: kept; 2 is written back to disk
    assert out is not None and out.keys_to_store == keys(3) and out.evicted_keys == keys(2)
    w.gpu[7] = bytes(key(3))
    assert w.run(GPULoadStoreSpec([7]), out.store_spec)
    m.complete_store(keys(1, 3))  # the very keys given to prepare_store
    assert m.num_in_flight() == 0
    assert m.tier_of(keys(1, 2, 3)) == ["CPU", "DISK", "CPU"]


def test_complete_store_leaves_a_promotion_to_its_load() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    store(w, m, [3])  # 2 goes down to disk
    spec = m.prepare_load(keys(2))  # promotes 2 into a CPU slot
    assert m.cpu.is_storing(key(2))
    m.prepare_store(keys(2))  # a store of 2 gets nothing to do ...
    m.complete_store(keys(2))  # ... and its completion must not settle the promotion
    assert m.cpu.is_storing(key(2))
    w.run(spec, GPULoadStoreSpec([0]))
    m.complete_load(keys(2), success=False)
    assert not m.cpu.is_stored(key(2))  # the failed promotion is dropped, not served


@pytest.mark.parametrize("remote", [False, True])
def test_reset_cache_is_all_or_nothing(remote: bool) -> None:
    w, m = make(cpu_blocks=2, remote=remote)
    store(w, m, [1, 2])
    store(w, m, [3])  # 2 goes down
    media(m)
    spec = m.prepare_load(keys(2))  # in flight: a promotion
    assert not m.can_reset_cache() and m.reset_cache() is False
    assert m.cpu.num_stored_blocks() == 1 and m.cpu.is_storing(key(2))  # nothing changed
    w.run(spec, GPULoadStoreSpec([0]))
    m.complete_load(keys(2), success=True)
    media(m)
    assert m.reset_cache() is True
    events = media(m)
    assert all(removed for _, removed, _ in events)
    assert any(med == "CPU" for med, _, _ in events) and any(med == "DISK" for med, _, _ in events)
    assert m.lookup(keys(1)) == (1 if remote and bytes(key(1)) in w.remote else 0)
    assert m.cpu.num_stored_blocks() == 0 and m.lower[0].num_stored_blocks() == 0  # type: ignore[attr-defined]


def test_forced_reset_drops_jobs_in_flight() -> None:
    w, m = make(cpu_blocks=2)
    store(w, m, [1, 2])
    m.prepare_store(keys(3))  # a write-back in flight
    m.prepare_load(keys(1))
    assert m.reset_cache(force=True) is True
    assert m.num_in_flight() == 0 and m.cpu.num_free_blocks() == 2
    assert m.lookup(keys(1, 2, 3)) == 0
