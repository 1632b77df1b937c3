"""CPU -> disk -> Redis through the real worker: bit-identical loads, restarts, faults, sharing."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvoffload.tiers.disk.store import DiskStoreError, DiskStoreMismatchError
from kvoffload.transfer.layout import KVGeometry
from tests.conftest_redis import RedisServer, free_port
from tests.tiers.tier_rig import GEOM, Rig, tkey


def test_write_back_cascade_then_loads_from_every_tier(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    rig = Rig(cpu_blocks=3, disk_dir=tmp_path, disk_blocks=5, redis_url=redis_server.url)
    try:
        for i in range(16):
            assert rig.store([i]) is True
        tiers = rig.m.tier_of([tkey(i) for i in range(16)])
        assert tiers.count("CPU") == 3 and tiers.count("DISK") == 5 and tiers.count("REMOTE") == 8
        rig.clobber()
        order = np.random.default_rng(1).permutation(16).tolist()
        for i in order:
            assert rig.load([i]) == (1, True)
        by = rig.tiers.load_blocks_by_medium()
        assert by.get("DISK", 0) > 0 and by.get("REMOTE", 0) > 0
        st = rig.tiers.handler.stats
        assert st.blocks[("DISK", "CPU")] and st.blocks[("REMOTE", "CPU")]
        assert st.blocks[("CPU", "DISK")] and st.blocks[("DISK", "REMOTE")]
        assert st.best_effort_failures == 0 and st.required_failures == 0
    finally:
        rig.close()


@pytest.mark.parametrize("kind", ["layer_first", "cross_layer"])
def test_chain_loads_from_cpu_and_disk_in_one_job(tmp_path: Path, kind: str) -> None:
    rig = Rig(cpu_blocks=6, disk_dir=tmp_path, disk_blocks=16, kind=kind)
    try:
        assert rig.store(list(range(6)), list(range(1, 7)))
        assert rig.store(list(range(100, 104)), list(range(10, 14)))  # evicts the chain's tail
        chain = [tkey(i) for i in range(6)]
        assert rig.m.tier_of(chain) == ["CPU"] * 2 + ["DISK"] * 4
        rig.clobber()
        assert rig.load(list(range(6))) == (6, True)
        assert rig.m.tier_of(chain) == ["CPU"] * 6  # promoted
        rig.clobber()
        assert rig.load(list(range(6)), first_gpu=20) == (6, True)
    finally:
        rig.close()


def test_write_through_keeps_every_tier_full(tmp_path: Path, redis_server: RedisServer) -> None:
    rig = Rig(
        cpu_blocks=2,
        disk_dir=tmp_path,
        disk_blocks=4,
        redis_url=redis_server.url,
        write_mode="write_through",
    )
    try:
        for i in range(6):
            assert rig.store([i])
        assert rig.tiers.redis_store is not None
        assert all(rig.tiers.redis_store.contains_many([tkey(i) for i in range(6)]))
        rig.clobber()
        for i in range(6):
            assert rig.load([i]) == (1, True)
    finally:
        rig.close()


# -- disk: restart, corruption, start-up errors ---------------------------------------------


def test_restart_finds_the_disk_tier_again(tmp_path: Path) -> None:
    rig = Rig(cpu_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    for i in range(8):
        rig.store([i])
    truth = dict(rig.truth)
    on_disk = [i for i, t in enumerate(rig.m.tier_of([tkey(i) for i in range(8)])) if t == "DISK"]
    assert len(on_disk) == 6
    rig.close()
    # A new process: empty CPU tier, the same directory.
    rig2 = Rig(cpu_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    try:
        rig2.truth = truth
        assert rig2.m.tier_of([tkey(i) for i in on_disk]) == ["DISK"] * 6
        ev = [e for e in rig2.m.take_events() if e.medium == "DISK" and not e.removed]
        assert sorted(ev[0].keys) == sorted(tkey(i) for i in on_disk)  # announced at start
        for i in on_disk:
            assert rig2.load([i]) == (1, True)
    finally:
        rig2.close()


def test_corrupt_disk_block_is_never_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(cpu_blocks=1, disk_dir=tmp_path, disk_blocks=4)
    try:
        rig.store([1])
        rig.store([2])  # 1 -> disk
        store = rig.tiers.disk_store
        assert store is not None
        slot = store.slot_of(tkey(1))
        assert slot is not None
        with open(tmp_path / "slab-00000.bin", "r+b") as f:
            f.seek(slot * store.slot_bytes + 5)
            f.write(b"\xde\xad")
        with caplog.at_level(logging.WARNING):
            assert rig.load([1]) == (1, False)  # a failed load: the engine recomputes
        assert "checksum mismatch" in caplog.text
        assert rig.m.tier_of([tkey(1)]) == [None]  # dropped, not offered again
        assert rig.load([1]) == (0, False)
    finally:
        rig.close()


def test_truncated_disk_tier_after_restart(tmp_path: Path) -> None:
    rig = Rig(cpu_blocks=1, disk_dir=tmp_path, disk_blocks=4)
    for i in range(5):
        rig.store([i])  # 0..3 -> disk
    truth = dict(rig.truth)
    slot_bytes = rig.tiers.disk_store.slot_bytes  # type: ignore[union-attr]
    slots = {i: rig.tiers.disk_store.slot_of(tkey(i)) for i in range(4)}  # type: ignore[union-attr]
    rig.close()
    import os

    os.truncate(tmp_path / "slab-00000.bin", 2 * slot_bytes)
    rig2 = Rig(cpu_blocks=1, disk_dir=tmp_path, disk_blocks=4)
    try:
        rig2.truth = truth
        kept = [i for i, s in slots.items() if s is not None and s < 2]
        assert sorted(i for i in range(4) if rig2.m.tier_of([tkey(i)]) == ["DISK"]) == kept
        for i in kept:
            assert rig2.load([i]) == (1, True)
    finally:
        rig2.close()


def test_mismatched_engine_refuses_the_directory(tmp_path: Path) -> None:
    Rig(cpu_blocks=1, disk_dir=tmp_path).close()
    other = KVGeometry(
        num_layers=GEOM.num_layers,
        num_kv_heads=GEOM.num_kv_heads,
        head_size=GEOM.head_size,
        block_size=GEOM.block_size,
        dtype="bfloat16",
    )
    with pytest.raises(DiskStoreMismatchError, match="dtype: 'float16' vs 'bfloat16'"):
        Rig(cpu_blocks=1, disk_dir=tmp_path, geometry=other)
    with pytest.raises(DiskStoreMismatchError, match="layout: 'layer_first' vs 'cross_layer'"):
        Rig(cpu_blocks=1, disk_dir=tmp_path, kind="cross_layer")
    with pytest.raises(DiskStoreMismatchError, match="model: 'test:rig-model' vs 'other'") as e:
        Rig(cpu_blocks=1, disk_dir=tmp_path, model_id="other")
    assert "\n" not in str(e.value)


def test_unusable_disk_dir_is_a_start_up_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(DiskStoreError, match="not a directory"):
        Rig(cpu_blocks=1, disk_dir=f)


def test_bad_redis_url_is_a_start_up_error() -> None:
    with pytest.raises(ValueError, match="scheme"):
        Rig(cpu_blocks=1, redis_url="http://localhost:6379")


# -- redis: outages and sharing ---------------------------------------------------------


def test_redis_killed_mid_run_and_restarted(redis_server: RedisServer) -> None:
    rig = Rig(cpu_blocks=1, redis_url=redis_server.url, redis_timeout_s=0.3)
    assert rig.tiers.redis_store is not None
    rig.tiers.redis_store.retry_interval_s = 0  # every call probes: no clock in the test
    try:
        for i in range(4):
            assert rig.store([i])
        assert rig.load([0]) == (1, True)
        redis_server.kill()
        for i in range(4, 8):
            assert rig.store([i]) is True  # the CPU tier goes on; write-downs are skipped
        for i in range(1, 4):
            assert rig.load([i]) == (0, False)  # misses, not errors or hangs
        redis_server.start()  # empty
        for i in range(8, 12):
            assert rig.store([i])
        rig.clobber()
        assert rig.load([10]) == (1, True)  # written down after the server returned
    finally:
        rig.close()


def test_unreachable_redis_at_start_up_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        rig = Rig(cpu_blocks=1, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert "unreachable" in caplog.text
        assert rig.store([1]) and rig.store([2])
        assert rig.load([1]) == (0, False)
    finally:
        rig.close()


def test_two_instances_share_one_server(redis_server: RedisServer) -> None:
    a = Rig(cpu_blocks=1, redis_url=redis_server.url)
    b = Rig(cpu_blocks=1, redis_url=redis_server.url)
    try:
        for i in range(5):
            a.store([i])  # 0..3 written down to the server
        b.truth = a.truth
        assert b.m.lookup([tkey(i) for i in range(4)]) == 1  # one CPU slot to promote into
        for i in range(4):
            assert b.load([i]) == (1, True)
        assert b.tiers.load_blocks_by_medium().get("REMOTE") == 4
    finally:
        a.close()
        b.close()


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tests.tiers.tier_rig import Rig
    rig = Rig(cpu_blocks=1, redis_url=sys.argv[1])
    rig.rng = np.random.default_rng(7)
    for i in range(5):
        assert rig.store([i], [60])  # 0..3 are written down to the server
    rig.close()
    """
)


def test_two_processes_share_one_server(redis_server: RedisServer) -> None:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, redis_server.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert res.returncode == 0, res.stderr
    rig = Rig(cpu_blocks=1, redis_url=redis_server.url)
    try:
        rig.rng = np.random.default_rng(7)
        for i in range(5):  # the same KV the other process computed
            rig.truth[tkey(i)] = rig.fill(60)
        for i in range(4):
            assert rig.load([i]) == (1, True)
        assert rig.tiers.load_blocks_by_medium().get("REMOTE") == 4
    finally:
        rig.close()
