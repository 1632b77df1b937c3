"""The Mooncake tier in the stack (``make_tiers``): zero-copy slots, events, two instances.

The rig (``tests.tiers.tier_rig``) plays the connector with the real worker
and handlers and checks every loaded byte against what was stored.
"""

from __future__ import annotations

import pytest

from tests.tiers.mooncake.required import need_mooncake

need_mooncake()

from kvoffload.tiers.lower_tier import REMOTE_MEDIUM  # noqa: E402
from kvoffload.tiers.mooncake.handler import MooncakeTransferHandler  # noqa: E402
from kvoffload.tiers.mooncake.store import MooncakeBlockStore  # noqa: E402
from tests.tiers.mooncake.cluster import LoopbackMooncake  # noqa: E402
from tests.tiers.mooncake.conftest import wait_for_room  # noqa: E402
from tests.tiers.tier_rig import Rig, tkey  # noqa: E402


def mooncake_rig(cluster: LoopbackMooncake, **kw: object) -> Rig:
    rig = Rig(cpu_blocks=1, mooncake_url=cluster.url, **kw)  # type: ignore[arg-type]
    wait_for_room(store_of(rig))
    return rig


def store_of(rig: Rig) -> MooncakeBlockStore:
    (tier,) = rig.tiers.tiers
    assert isinstance(tier.store, MooncakeBlockStore)
    return tier.store


def handler_of(rig: Rig) -> MooncakeTransferHandler:
    (tier,) = rig.tiers.tiers
    assert isinstance(tier.handler, MooncakeTransferHandler)
    return tier.handler


def settled_load(rig: Rig, ids: list[int]) -> tuple[int, bool]:
    """Look up (presence is asked off-thread: a first lookup may not know yet), then load."""
    rig.m.lookup([tkey(i) for i in ids])
    assert rig.m.lower[0].wait_answers(10)
    return rig.load(ids)


@pytest.mark.parametrize(("kind", "zero_copy"), [("cross_layer", True), ("layer_first", False)])
def test_write_down_and_load_back(mooncake: LoopbackMooncake, kind: str, zero_copy: bool) -> None:
    rig = mooncake_rig(mooncake, kind=kind)
    try:
        assert handler_of(rig).zero_copy is zero_copy
        for i in range(5):
            assert rig.store([i])  # one CPU slot: 0..3 are written down
        rig.clobber()
        for i in range(4):
            assert settled_load(rig, [i]) == (1, True), i
        assert rig.tiers.load_blocks_by_medium().get(REMOTE_MEDIUM) == 4
    finally:
        rig.close()


def test_events_announce_the_store_and_its_namespace(mooncake: LoopbackMooncake) -> None:
    rig = mooncake_rig(mooncake, mooncake_namespace="fleet-a")
    try:
        for i in range(3):
            rig.store([i])
        remote = [e for e in rig.m.take_events() if e.medium == REMOTE_MEDIUM]
        assert remote and not any(e.removed for e in remote)
        assert {k for e in remote for k in e.keys} == {tkey(0), tkey(1)}
        ownership = rig.m.lower[0].event_ownership  # type: ignore[attr-defined]
        assert ownership == store_of(rig).ownership
        assert ownership.startswith("mooncake:fleet-a:")
    finally:
        rig.close()


def test_two_instances_share_one_master(mooncake: LoopbackMooncake) -> None:
    a = mooncake_rig(mooncake, kind="cross_layer", mooncake_namespace="shared")
    b = mooncake_rig(mooncake, kind="cross_layer", mooncake_namespace="shared")
    try:
        for i in range(5):
            a.store([i])  # 0..3 written down
        b.truth = a.truth
        for i in range(4):
            assert settled_load(b, [i]) == (1, True)
        assert b.tiers.load_blocks_by_medium().get(REMOTE_MEDIUM) == 4
    finally:
        a.close()
        b.close()


def test_master_killed_mid_run_the_engine_goes_on(fresh_mooncake: LoopbackMooncake) -> None:
    fresh_mooncake.add_holder(16 << 20)
    rig = mooncake_rig(fresh_mooncake, kind="cross_layer")
    store = store_of(rig)
    try:
        for i in range(3):
            assert rig.store([i])
        fresh_mooncake.kill_master()
        for i in range(3, 8):
            assert rig.store([i]) is True  # the CPU tier goes on; write-downs fail fast
        assert not store.available  # the first write-down that met the dead master tripped it
        skipped = store.stats.calls_skipped
        for i in range(2):
            # Presence still says "stored" (this instance stored them): the load fails at
            # once (skipped, not a 4.3 s RPC) and the engine recomputes; then a miss.
            assert settled_load(rig, [i])[1] is False
            assert rig.m.lookup([tkey(i)]) == 0
        assert store.stats.calls_skipped > skipped
    finally:
        rig.close()
        fresh_mooncake.start_master()
