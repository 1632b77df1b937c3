"""``KVOffloadManager``: vLLM's manager contract over kvoffload's CPU tier."""

from tests.vllm_required import need_vllm

need_vllm()

import pytest  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    make_offload_key,
)

from kvoffload.integrations.vllm import KVOffloadManager, parse_settings  # noqa: E402
from kvoffload.integrations.vllm.settings import KVOffloadConfigError  # noqa: E402
from kvoffload.offload import CPUOffloadingManager  # noqa: E402

HIT, MISS = LookupResult.HIT, LookupResult.MISS
HIT_PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY


def key(i: int):
    return make_offload_key(i.to_bytes(32, "big"), 0)


def ctx(name: str = "r") -> ReqContext:
    return ReqContext(req_id=name)


def cpu_only(n: int = 4, **kw) -> KVOffloadManager:
    return KVOffloadManager(CPUOffloadingManager(n, "lru", enable_events=True), **kw)


def store(m: KVOffloadManager, keys, ok: bool = True) -> None:
    out = m.prepare_store(keys, ctx())
    assert out is not None
    m.complete_store(set(out.keys_to_store), ctx(), success=ok)


def test_a_block_being_stored_is_hit_pending_then_hit() -> None:
    m = cpu_only()
    out = m.prepare_store([key(1), key(2)], ctx())
    assert out is not None and out.keys_to_store == [key(1), key(2)]
    assert m.lookup(key(1), ctx()) is HIT_PENDING
    assert m.lookup(key(3), ctx()) is MISS
    # vLLM completes by key set, in any order.
    m.complete_store({key(2), key(1)}, ctx())
    assert m.lookup(key(1), ctx()) is HIT
    assert m.num_in_flight() == 0


def test_a_failed_store_is_forgotten() -> None:
    m = cpu_only()
    store(m, [key(1)], ok=False)
    assert m.lookup(key(1), ctx()) is MISS
    assert m.failed_stores == 1


def test_complete_store_of_keys_already_stored_is_ignored() -> None:
    m = cpu_only()
    store(m, [key(1)])
    out = m.prepare_store([key(1), key(2)], ctx())
    assert out is not None and out.keys_to_store == [key(2)]
    m.complete_store({key(2)}, ctx())
    m.complete_store({key(1)}, ctx())  # nothing in flight for it: a no-op
    assert m.lookup(key(2), ctx()) is HIT


def test_loads_pin_until_complete_load_by_key_set() -> None:
    m = cpu_only(2)
    store(m, [key(1), key(2)])
    m.prepare_load([key(1), key(2)], ctx())
    assert m.prepare_store([key(3)], ctx()) is None  # everything pinned
    m.complete_load({key(2), key(1)}, ctx())
    assert m.prepare_store([key(3)], ctx()) is not None


def test_store_threshold_counts_offers() -> None:
    m = cpu_only(store_threshold=2)
    first = m.prepare_store([key(1)], ctx())
    assert first is not None and first.keys_to_store == []
    second = m.prepare_store([key(1)], ctx())
    assert second is not None and second.keys_to_store == [key(1)]


def test_a_failed_load_is_counted_and_unpins_its_blocks() -> None:
    m = cpu_only(2)
    store(m, [key(1), key(2)])
    spec = m.prepare_load([key(1)], ctx())
    m.note_failed([spec.op_id])
    m.complete_load({key(1)}, ctx())
    assert m.failed_loads == 1 and m.num_in_flight() == 0
    assert m.cpu.num_evictable_blocks() == m.cpu.num_stored_blocks()


def test_events_are_the_primary_cpu_tiers() -> None:
    m = cpu_only(
        1,
    )
    store(m, [key(1)])
    store(m, [key(2)])  # key 1 evicted
    events = list(m.take_events())
    seen = {(e.medium, e.locality, e.ownership, e.removed) for e in events}
    assert seen == {(Medium.CPU, None, None, False), (Medium.CPU, None, None, True)}


@pytest.mark.parametrize(
    ("config", "key_name"),
    [
        ({"cpu_bytes": 1, "cpu_bytes_to_use": 1}, "cpu_bytes_to_use"),
        ({"cpu_bytes": "1GiB", "eviction_policy": "lru", "cache_policy": "arc"}, "eviction_policy"),
        ({"cpu_bytes": "1GiB", "cache_policy_module_path": "x.y"}, "cache_policy_module_path"),
        ({"cpu_bytes": "1GiB", "redis_url": "localhost:6379"}, "redis_url"),
        ({"cpu_bytes": "1GiB", "disk_bytes": "1GiB"}, "disk_bytes"),
        ({"cpu_bytes": "1GiB", "store_threshold": -1}, "store_threshold"),
        ({"cpu_bytes": "1GiB", "canonical_layout": True}, "canonical_layout"),
    ],
)
def test_settings_errors_name_the_key(config: dict, key_name: str) -> None:
    with pytest.raises(KVOffloadConfigError) as info:
        parse_settings(config)
    assert repr(key_name) in str(info.value) and "\n" not in str(info.value)


def test_settings_take_vllms_names_with_vllms_meaning() -> None:
    s = parse_settings({"cpu_bytes_to_use": 4 << 30, "eviction_policy": "arc", "block_size": 64})
    assert s.cpu_bytes == 4 << 30 and s.cache_policy == "arc"
    s = parse_settings(
        {"cpu_bytes": "64GiB", "disk_dir": "/d", "disk_bytes": "1TiB", "write_through": "true"}
    )
    assert s.cpu_bytes == 64 << 30 and s.disk_bytes == 1 << 40 and s.write_through


def test_reset_cache_forgets_every_block_and_in_flight_job() -> None:
    m = cpu_only(2)
    store(m, [key(1)])
    m.prepare_store([key(3)], ctx())  # in flight at the reset: vLLM never completes it
    m.take_events()
    m.reset_cache()
    assert m.num_in_flight() == 0
    for i in (1, 3):
        assert m.lookup(key(i), ctx()) is MISS
    removed = {(e.medium, e.ownership) for e in m.take_events() if e.removed}
    assert removed == {(Medium.CPU, None)}
    store(m, [key(4)])
    assert m.lookup(key(4), ctx()) is HIT


def test_a_store_the_tier_declines_is_not_stored() -> None:
    """kvoffload's admission reaches vLLM: fewer keys_to_store, as its store_threshold."""
    cpu = CPUOffloadingManager(4, "chain_arms")
    for i in range(4):  # stored, then read: the tier's LRU holds four kept blocks
        cpu.prepare_store([key(i)])
        cpu.complete_store([key(i)])
        cpu.prepare_load([key(i)])
        cpu.complete_load([key(i)])
    m = KVOffloadManager(cpu)
    out = m.prepare_store([key(0), key(9)], ctx())
    assert out is not None and out.keys_to_store == []  # key 9: a first sighting
    assert out.evicted_keys == []
    m.complete_store({key(0), key(9)}, ctx())
    assert m.lookup(key(9), ctx()) is MISS
    assert all(m.lookup(key(i), ctx()) is HIT for i in range(4))
    store(m, [key(9)])  # the second sighting is admitted
    assert m.lookup(key(9), ctx()) is HIT


def test_a_cpu_tier_hit_is_counted_as_host_memory() -> None:
    """vLLM's per-source counter puts CPU-tier hits under "host", as its own CPU tier's."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    m = cpu_only()
    store(m, [key(1)])
    assert m.lookup(key(1), ctx()) is HIT
    assert m.get_load_source(key(1), ctx()) is CacheHitSource.HOST
