"""RemoteOffloadingManager: the server is the truth; stores skipped in an outage."""

from __future__ import annotations

import pytest

from kvoffload.offload import OffloadingEvent
from kvoffload.tiers.lower_tier import RemoteLoadStoreSpec
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from tests.offload.keyutil import keys
from tests.tiers.tier_world import World


def setup(events: bool = True) -> tuple[World, RemoteOffloadingManager]:
    w = World()
    return w, RemoteOffloadingManager(w.exists, w.available, enable_events=events)


def test_lookup_asks_the_server() -> None:
    w, m = setup()
    for k in keys(1, 2, 4):
        w.remote[bytes(k)] = bytes(k)  # stored by another engine
    assert m.lookup(keys(1, 2, 3, 4)) == 2
    assert m.stored_mask(keys(1, 3, 4)) == [True, False, True]
    w.remote_up = False
    assert m.lookup(keys(1, 2)) == 0


def test_store_skips_what_the_server_has_and_in_flight_keys() -> None:
    w, m = setup()
    w.remote[bytes(keys(1)[0])] = b"x"
    out = m.prepare_store(keys(1, 2, 3))
    assert out.keys_to_store == keys(2, 3) and out.evicted_keys == []
    assert out.store_spec == RemoteLoadStoreSpec(keys(2, 3))
    assert m.prepare_store(keys(2)).keys_to_store == []  # in flight
    assert m.lookup(keys(2)) == 0  # in flight: not loadable even if the server had it
    m.complete_store(keys(2, 3))
    assert m.take_events() == [OffloadingEvent(keys(2, 3), "REMOTE", removed=False)]


def test_outage_skips_stores() -> None:
    w, m = setup()
    w.remote_up = False
    assert m.prepare_store(keys(1, 2)).keys_to_store == []


def test_failed_store_is_not_announced() -> None:
    _, m = setup()
    m.prepare_store(keys(1))
    m.complete_store(keys(1), success=False)
    assert m.take_events() == []


def test_evicted_by_the_server_is_announced_as_removed() -> None:
    w, m = setup()
    out = m.prepare_store(keys(1, 2))
    for k in out.keys_to_store:
        w.remote[bytes(k)] = bytes(k)
    m.complete_store(out.keys_to_store)
    m.take_events()
    del w.remote[bytes(keys(1)[0])]
    assert m.lookup(keys(1, 2)) == 0
    assert m.take_events() == [OffloadingEvent(keys(1), "REMOTE", removed=True)]
    assert m.lookup(keys(1)) == 0
    assert m.take_events() == []  # once


def test_drop_forgets_announcements() -> None:
    _w, m = setup()
    out = m.prepare_store(keys(1))
    m.complete_store(out.keys_to_store)
    m.take_events()
    m.drop(keys(1, 2))
    assert m.take_events() == [OffloadingEvent(keys(1), "REMOTE", removed=True)]


def test_pins_count() -> None:
    _, m = setup()
    spec = m.prepare_load(keys(1, 1))
    assert spec.keys == keys(1, 1) and m.ref_count(keys(1)[0]) == 2
    m.complete_load(keys(1, 1))
    with pytest.raises(ValueError, match="not pinned"):
        m.complete_load(keys(1))


def test_announcements_are_bounded() -> None:
    _w, m = setup()
    m.max_announced = 2
    out = m.prepare_store(keys(1, 2, 3))
    m.complete_store(out.keys_to_store)
    assert len(m._announced) == 2
    assert m.answers_locally is False
    assert m.num_evictable_blocks() == 0 and m.num_free_blocks() > 1 << 30


def test_complete_store_accepts_the_keys_given_to_prepare_store() -> None:
    w, m = setup()
    w.remote[bytes(keys(1)[0])] = b"x"
    out = m.prepare_store(keys(1, 2))
    assert out.keys_to_store == keys(2)
    m.complete_store(keys(1, 2))
    assert m.take_events() == [OffloadingEvent(keys(2), "REMOTE", removed=False)]
    m.complete_store(keys(1, 2), success=False)  # nothing in flight: ignored
    assert m.take_events() == []


def test_reset_forgets_local_knowledge_only() -> None:
    """The namespace is shared: a reset deletes nothing on the server."""
    w, m = setup()
    out = m.prepare_store(keys(1, 2))
    for k in out.keys_to_store:
        w.remote[bytes(k)] = bytes(k)
    m.complete_store(out.keys_to_store)
    m.take_events()
    m.prepare_load(keys(1))
    assert m.reset_cache() is False  # pinned
    m.complete_load(keys(1))
    m.prepare_store(keys(3))
    assert m.reset_cache() is False  # storing
    m.complete_store(keys(3), success=False)
    assert m.reset_cache() is True
    assert m.take_events() == [OffloadingEvent(keys(1, 2), "REMOTE", removed=True)]
    assert set(w.remote) == {bytes(k) for k in keys(1, 2)}  # the server keeps them
    assert m.lookup(keys(1, 2)) == 2
    assert m.reset_cache(force=True) is True and m.take_events() == []
