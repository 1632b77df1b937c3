"""Redis presence's promise: a block stored later is seen from the step after.

``tiers/redis/presence.py`` answers lookups from what it knows and asks the
server off the scheduler thread. A key once answered absent must be asked
again, so a block another instance (a second client here) or this one
stores after that answer is a hit from the next step on.
"""

from __future__ import annotations

import numpy as np

from kvoffload.offload.base import make_offload_key
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.redis.presence import PresenceCache
from kvoffload.tiers.redis.store import RedisBlockStore
from tests.conftest_redis import RedisServer

BB = 64
WAIT_S = 10.0  # a hang guard for the presence thread, never reached when it works


def _store(url: str) -> RedisBlockStore:
    return RedisBlockStore(url, "presence", BB, timeout_s=1.0, hash_fn="sha256")


def _step(manager: RemoteOffloadingManager, keys: list[bytes]) -> int:
    """One scheduler step: a lookup, then the engine waits for the questions it raised."""
    hit = manager.lookup(keys)
    assert manager.wait_answers(WAIT_S)
    return hit


def test_a_block_another_instance_stores_later_is_seen_the_step_after(
    redis_server: RedisServer,
) -> None:
    mine, other = _store(redis_server.url), _store(redis_server.url)
    manager = RemoteOffloadingManager(
        mine.contains_many, lambda: mine.available, presence=PresenceCache(mine.contains_many)
    )
    key = make_offload_key(b"\x07" * 32)
    try:
        assert _step(manager, [key]) == 0  # never asked yet
        assert _step(manager, [key]) == 0  # asked: absent
        assert _step(manager, [key]) == 0  # still absent: the answer stays "absent"
        assert other.put([key], np.full((1, BB), 3, np.uint8)) == [True]
        # The step that asked after the store may still answer from the old
        # "absent"; the one after it must see the block.
        _step(manager, [key])
        assert _step(manager, [key]) == 1
    finally:
        manager.close()
        mine.close()
        other.close()


def test_a_block_this_instance_stores_is_seen_at_once(redis_server: RedisServer) -> None:
    store = _store(redis_server.url)
    manager = RemoteOffloadingManager(
        store.contains_many, lambda: store.available, presence=PresenceCache(store.contains_many)
    )
    key = make_offload_key(b"\x09" * 32)
    try:
        assert _step(manager, [key]) == 0
        assert _step(manager, [key]) == 0
        out = manager.prepare_store([key])
        assert out.keys_to_store == [key]
        assert store.put([key], np.zeros((1, BB), np.uint8)) == [True]
        manager.complete_store([key])
        assert manager.lookup([key]) == 1  # no round trip needed: this process knows
    finally:
        manager.close()
        store.close()
