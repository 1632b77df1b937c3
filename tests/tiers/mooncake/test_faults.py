"""Faults of a Mooncake Store, each with the handling it needs (issue 40).

- master killed: the first call that answers -900 trips the breaker; later
  calls never reach the client (each would wait ~4.3 s), they answer misses;
- master restarted: the probe reopens the tier; the old blocks are misses
  (the new master lost their metadata) and stores land again;
- segment holder killed: reads of its blocks miss (never wrong bytes), the
  keys are removed and held absent although the master still lists them;
- pool full: the store evicts on its own; every hit is the bytes stored and
  what was evicted is withdrawn from this instance's announcements.
(A value of the wrong size under our namespace: ``test_store``.)

The clock is never asserted on: a test waits for a state with a bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.tiers.mooncake.required import need_mooncake

need_mooncake()

from kvoffload.tiers.lower_tier import REMOTE_MEDIUM  # noqa: E402
from kvoffload.tiers.mooncake.client import open_client, parse_master_url  # noqa: E402
from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager  # noqa: E402
from tests.tiers.mooncake.cluster import LoopbackMooncake  # noqa: E402
from tests.tiers.mooncake.conftest import CountingClient, open_store, wait_until  # noqa: E402

BLOCK = 4096


def data(n: int, seed: int = 0, block: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block), dtype=np.uint8)


def keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") for i in range(n)]


def test_master_killed_trips_the_breaker_at_the_first_failure(
    fresh_mooncake: LoopbackMooncake,
) -> None:
    fresh_mooncake.add_holder(16 << 20)
    real = open_client(parse_master_url(fresh_mooncake.url))
    counting = CountingClient(real)
    store = open_store(fresh_mooncake, BLOCK, client=counting)
    try:
        ks, blocks = keys(4), data(4)
        assert store.put(ks, blocks) == [True] * 4
        fresh_mooncake.kill_master()
        before = counting.calls
        for round_ in range(3):
            assert all(g is None for g in store.get(ks))  # misses, not errors
            assert store.contains_many(ks) == [False] * 4
            assert store.put(keys(2, 100 + 2 * round_), data(2)) == [False, False]
        assert not store.available
        # Only the call that met the dead master went out; the other eight were skipped
        # (each would have waited ~4.3 s for its RPC to time out).
        assert counting.calls - before == 1
        assert store.stats.calls_skipped == 8
        assert store.stats.outages == 1
    finally:
        store.close()
        fresh_mooncake.start_master()
        real.close()


def test_master_restarted_loses_the_blocks_then_serves_again(
    fresh_mooncake: LoopbackMooncake,
) -> None:
    fresh_mooncake.add_holder(16 << 20)
    store = open_store(fresh_mooncake, BLOCK, probe_interval_s=0.05)
    try:
        old, blocks = keys(4), data(4)
        assert store.put(old, blocks) == [True] * 4
        fresh_mooncake.kill_master()
        assert all(g is None for g in store.get(old))
        assert not store.available
        fresh_mooncake.start_master()
        assert wait_until(lambda: store.available), "the probe never reopened the tier"
        assert store.stats.outages == 1 and store.breaker.outage_s
        # The new master knows nothing of the old blocks: misses, not errors.
        assert store.contains_many(old) == [False] * 4
        assert all(g is None for g in store.get(old))
        # Its holder mounts its segment again by itself: stores land.
        new = keys(4, 50)
        assert wait_until(lambda: store.put(new[:1], blocks[:1])[0])
        assert store.put(new, blocks) == [True] * 4
        got = store.get(new)
        assert all(g is not None and (g == b).all() for g, b in zip(got, blocks))
    finally:
        store.close()


def test_segment_holder_killed_is_misses_never_wrong_kv(tmp_path: Path) -> None:
    # The master keeps a silent holder's segment for 30 s: long enough that it still
    # lists the dead holder's blocks when this test asks.
    cluster = LoopbackMooncake(tmp_path / "mc", client_ttl_s=30)
    try:
        holder = cluster.add_holder(16 << 20)
        store = open_store(cluster, BLOCK, probe_interval_s=0.05)
        raw = open_client(parse_master_url(cluster.url))
        try:
            ks, blocks = keys(6), data(6)
            assert store.put(ks, blocks) == [True] * 6
            cluster.kill_holder(holder)
            out = np.zeros_like(blocks)
            assert store.get_into(ks, out) == [False] * 6
            assert not out.any()  # a miss leaves the caller's buffer alone
            assert store.stats.lost_blocks == 6
            # The master may still list them (until its client TTL), the store does not.
            assert store.contains_many(ks) == [False] * 6
            assert wait_until(lambda: store.available)
            assert all(c != 1 for c in raw.batch_is_exist([store.object_key(k) for k in ks]))
        finally:
            store.close()
            raw.close()
    finally:
        cluster.close()


def test_a_full_pool_evicts_misses_never_wrong_bytes(tmp_path: Path) -> None:
    # The master evicts from half full, a fifth at a time (its defaults: 90%, 5%), so a
    # 16 MiB pool (64 blocks) turns over while this test keeps storing.
    cluster = LoopbackMooncake(
        tmp_path / "mc",
        master_flags=("--eviction_high_watermark_ratio=0.5", "--eviction_ratio=0.2"),
    )
    block = 256 << 10
    try:
        cluster.add_holder(16 << 20)
        store = open_store(cluster, block)
        manager = MooncakeOffloadingManager(store, enable_events=True)
        payloads = data(16, 7, block)  # key i holds payloads[i % 16]
        every: list[bytes] = []

        def store_a_batch() -> int:
            ks = keys(16, len(every))
            every.extend(ks)
            manager.stored_mask(ks)  # new keys: absent, no lease taken
            assert manager.wait_answers(10)
            out = manager.prepare_store(ks)
            ok = store.put(out.keys_to_store, payloads[: len(out.keys_to_store)])
            manager.complete_store([k for k, g in zip(out.keys_to_store, ok) if g], True)
            manager.complete_store([k for k, g in zip(out.keys_to_store, ok) if not g], False)
            return store.stats.blocks_written

        try:
            # More accepted than the pool holds: the pool evicted (a refused put is counted).
            assert wait_until(lambda: store_a_batch() > 2 * 64, timeout_s=60, step_s=0.05)
            stored = {k for e in manager.take_events() if not e.removed for k in e.keys}
            got = store.get(every)
            hits = [i for i, g in enumerate(got) if g is not None]
            assert 0 < len(hits) < len(stored)  # evicted some, kept some
            for i in hits:
                assert (got[i] == payloads[i % 16]).all(), "a hit with the wrong bytes"
            # What the store evicted is withdrawn once this instance asks about it.
            manager.presence.forget()  # type: ignore[union-attr]
            manager.stored_mask(every)
            assert manager.wait_answers(10)
            mask = manager.stored_mask(every)
            events = manager.take_events()
            assert events and all(e.medium == REMOTE_MEDIUM and e.removed for e in events)
            removed = {k for e in events for k in e.keys}
            gone = {k for k, there in zip(every, mask) if not there}
            assert gone & stored and gone & stored <= removed
            assert not removed - gone  # nothing still held is withdrawn
        finally:
            manager.close()
            store.close()
    finally:
        cluster.close()
