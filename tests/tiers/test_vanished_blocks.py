"""A block that leaves a lower tier between lookup and load is a miss, never a crash.

A Redis under ``maxmemory`` + ``allkeys-lru`` evicts whenever it likes; a TTL
expires; another engine resets. The tiered manager must turn such a load into
a failed job (the engine recomputes those tokens), with nothing left pinned.
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from kvoffload.offload import CPUOffloadingManager, GPULoadStoreSpec
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.lower_tier import TieredLoadStoreSpec
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.tiered_manager import TieredOffloadingManager
from tests.conftest_redis import RedisServerFactory
from tests.offload.keyutil import keys
from tests.tiers.tier_rig import Rig, tkey
from tests.tiers.tier_world import World


def remote_stack(w: World) -> TieredOffloadingManager:
    cpu = CPUOffloadingManager(4, "lru", enable_events=True)
    remote = RemoteOffloadingManager(w.exists, w.available, enable_events=True)
    return TieredOffloadingManager(cpu, [remote])


def test_key_evicted_from_redis_between_lookup_and_prepare_load_is_a_failed_load() -> None:
    w = World()
    m = remote_stack(w)
    ks = keys(1, 2, 3)
    for k in ks:
        w.remote[bytes(k)] = bytes(k)  # stored by another engine
    assert m.lookup(ks) == 3
    del w.remote[bytes(ks[1])]  # the server evicts it
    spec = m.prepare_load(ks)
    assert isinstance(spec, TieredLoadStoreSpec) and spec.error
    assert not w.run(spec, GPULoadStoreSpec([0, 1, 2]))
    m.complete_load(ks, success=False)
    assert m.stats.vanished_loads == 1
    assert m.num_in_flight() == 0
    assert all(t.ref_count(k) == 0 for t in (m.cpu, *m.lower) for k in ks)
    # The rest still loads (the evicted block is a plain miss next time).
    assert m.lookup(ks) == 1


def test_key_dropped_from_disk_between_lookup_and_prepare_load_is_a_failed_load() -> None:
    cpu = CPUOffloadingManager(4, "lru")
    disk = DiskOffloadingManager(4, restored=[(k, s) for s, k in enumerate(keys(1, 2))])
    m = TieredOffloadingManager(cpu, [disk])
    assert m.lookup(keys(1, 2)) == 2
    disk.drop(keys(2))
    spec = m.prepare_load(keys(1, 2))
    assert isinstance(spec, TieredLoadStoreSpec) and spec.error
    m.complete_load(keys(1, 2), success=False)
    assert disk.ref_count(keys(1)[0]) == 0 and m.num_in_flight() == 0


def flood(url: str, present: Callable[[], list[bool]]) -> None:
    """Write filler until the server has evicted every block ``present()`` asks about."""
    client = redis.Redis.from_url(url)
    filler = b"\0" * (64 * 1024)
    try:
        for i in range(2000):
            client.set(f"filler:{i}", filler)
            if i % 16 == 15 and not any(present()):
                return
        raise AssertionError("the server never evicted the rig's blocks")
    finally:
        client.close()


def test_real_redis_with_allkeys_lru_evicting_between_lookup_and_load(
    redis_server_factory: RedisServerFactory,
) -> None:
    server = redis_server_factory(maxmemory="3mb", maxmemory_policy="allkeys-lru")
    rig = Rig(cpu_blocks=4, redis_url=server.url)
    store = rig.tiers.redis_store
    assert store is not None
    try:
        for i in range(8):  # write-back: the CPU tier's victims go down to Redis
            assert rig.store([i])
        ids = [0, 1, 2]
        ks = [tkey(i) for i in ids]
        assert rig.m.lookup(ks) == 3
        flood(server.url, lambda: store.contains_many(ks))
        assert not rig.finish_load(ks)  # prepare_load after the eviction: a miss
        assert rig.m.stats.vanished_loads == 1
        # Evicted after prepare_load, during the read: also a failed load.
        for i in range(10, 18):
            assert rig.store([i])
        ks = [tkey(10), tkey(11), tkey(12)]
        assert rig.m.lookup(ks) == 3
        spec = rig.m.prepare_load(ks)
        flood(server.url, lambda: store.contains_many(ks))
        assert not rig.run_load(spec, ks)
        rig.m.complete_load(ks, success=False)
        assert rig.m.num_in_flight() == 0
        assert rig.m.lookup(ks) == 0  # gone: a plain miss now
    finally:
        rig.close()
