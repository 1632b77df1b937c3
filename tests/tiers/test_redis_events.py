"""The Redis tier's events: each key announced once, withdrawn when forgotten (exact sets)."""

from kvoffload.offload.base import OffloadingEvent, make_offload_key
from kvoffload.tiers.redis.manager import RemoteOffloadingManager


def _keys(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(32, "big")) for i in ids]


def _manager(max_announced: int) -> tuple[set[bytes], RemoteOffloadingManager]:
    server: set[bytes] = set()
    m = RemoteOffloadingManager(
        lambda ks: [bytes(k) in server for k in ks],
        enable_events=True,
        max_announced=max_announced,
        ownership="redis:ns:abc",
    )
    return server, m


def _store(m: RemoteOffloadingManager, server: set[bytes], keys: list[bytes]) -> None:
    out = m.prepare_store(keys)
    server.update(bytes(k) for k in out.keys_to_store)
    m.complete_store(out.keys_to_store)


def test_forgotten_announcements_are_withdrawn() -> None:
    server, m = _manager(max_announced=2)
    assert m.event_ownership == "redis:ns:abc"
    _store(m, server, _keys(1, 2, 3))
    assert m.take_events() == [
        OffloadingEvent(_keys(1), "REMOTE", removed=True),
        OffloadingEvent(_keys(2, 3), "REMOTE", removed=False),
    ]


def test_a_key_is_announced_once() -> None:
    server, m = _manager(max_announced=8)
    _store(m, server, _keys(1))
    server.clear()  # evicted by the server, unnoticed: the store goes again
    _store(m, server, _keys(1))
    assert m.take_events() == [OffloadingEvent(_keys(1), "REMOTE", removed=False)]


def test_a_set_fed_with_events_is_what_the_manager_vouches_for() -> None:
    server, m = _manager(max_announced=3)
    held: set[bytes] = set()
    for batch in ([1, 2], [3, 4], [2, 5], [6], [1]):
        _store(m, server, _keys(*batch))
        for ev in m.take_events():
            for k in ev.keys:
                if ev.removed:
                    assert k in held
                    held.discard(k)
                else:
                    assert k not in held
                    held.add(k)
        assert held == set(m._announced)
