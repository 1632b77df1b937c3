"""Redis presence off the scheduler thread inside the reference engine.

The connector defers a waiting request while the Redis tier is still asking
whether it holds the request's next block, a bounded number of steps: a
block another engine stored is served at first sight, the scheduler thread
never reads a Redis reply, and a server that never answers delays a request
by at most the bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis.connection

from kvoffload.engine import llm_engine
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.connector.scheduler import MAX_LOOKUP_DEFER_STEPS
from kvoffload.engine.llm_engine import LLMEngine
from kvoffload.engine.request import SamplingParams
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from tests.conftest_redis import RedisServer, redis_server, redis_server_factory
from tests.tiers.sockets import GatedProxy

__all__ = ["redis_server", "redis_server_factory"]

BS = 8
KW: dict[str, Any] = {
    "block_size": BS,
    "num_gpu_blocks": 16,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 64,
    "num_cpu_blocks": 8,
}
SP = SamplingParams(max_tokens=2)


def prompt(i: int) -> list[int]:
    return [(13 * j + 7 * i + 1) % 500 for j in range(4 * BS + 3)]


def remote_of(engine: LLMEngine) -> RemoteOffloadingManager:
    assert engine.offload is not None
    lower = engine.offload.manager.lower  # type: ignore[attr-defined]
    remote = lower[0]
    assert isinstance(remote, RemoteOffloadingManager)
    return remote


def fill(url: str, n: int) -> list[list[int]]:
    """A first engine writes ``n`` prompts' blocks through to Redis; their answers."""
    with LLMEngine(EngineConfig(redis_url=url, write_through=True, **KW)) as engine:
        outs = [engine.generate([prompt(i)], SP)[0] for i in range(n)]
        engine.drain()
    return outs


class DeferralLog:
    """Per request, how many times the connector said "ask again next step"."""

    def __init__(self, engine: LLMEngine) -> None:
        conn = engine.connector
        assert conn is not None
        real = conn.get_num_new_matched_tokens
        self.deferred: dict[str, int] = {}
        self.admitted: set[str] = set()

        def spy(req_id: str, *a: Any) -> int | None:
            n = real(req_id, *a)
            if n is None:
                self.deferred[req_id] = self.deferred.get(req_id, 0) + 1
            else:
                self.admitted.add(req_id)
            return n

        conn.get_num_new_matched_tokens = spy  # type: ignore[method-assign]


@pytest.fixture
def reply_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[threading.Thread]]:
    """Threads that read a Redis reply (every round trip ends in one).

    Thread objects, not idents: an ident is reused once its thread has ended.
    """
    seen: list[threading.Thread] = []
    real = redis.connection.AbstractConnection.read_response

    def read_response(self: Any, *a: Any, **kw: Any) -> Any:
        seen.append(threading.current_thread())
        return real(self, *a, **kw)

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
    yield seen


def test_engine_asks_redis_off_the_scheduler_thread_by_default() -> None:
    cfg = EngineConfig(redis_url="redis://127.0.0.1:1/0", **KW)
    tiers = cfg.tier_config()
    assert tiers is not None and tiers.redis_async_presence


def test_a_first_sight_redis_hit_after_a_restart_is_served(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle step's wait ends when the answer lands; a long cap keeps a loaded CI
    # machine from turning the hit into a miss (the bound is in steps, not seconds).
    monkeypatch.setattr(llm_engine, "LOOKUP_WAIT_S", 30.0)
    ref = fill(redis_server.url, 1)
    with LLMEngine(EngineConfig(redis_url=redis_server.url, **KW)) as engine:  # a restart
        assert remote_of(engine).presence is not None
        log = DeferralLog(engine)
        assert engine.generate([prompt(0)], SP) == ref
        engine.drain()
        by_medium = engine.offload.manager.hit_blocks_by_medium()  # type: ignore[union-attr]
    assert by_medium.get("REMOTE", 0) == 4  # every full block, none recomputed
    assert 1 <= sum(log.deferred.values()) <= MAX_LOOKUP_DEFER_STEPS


def test_the_scheduler_thread_never_reads_a_redis_reply(
    redis_server: RedisServer, reply_threads: list[threading.Thread]
) -> None:
    ref = fill(redis_server.url, 3)
    proxy = GatedProxy(redis_server.port)
    try:
        with LLMEngine(EngineConfig(redis_url=proxy.url, **KW)) as engine:
            reply_threads.clear()
            outs: list[list[list[int]]] = []
            t = threading.Thread(target=lambda: outs.append(engine.generate([prompt(1)], SP)))
            with proxy.hold():  # no reply comes back while held
                t.start()
                t.join(timeout=60)  # a hang detector, not a timing assertion
                assert not t.is_alive(), "the engine waited for a Redis reply"
            assert outs == [[ref[1]]]  # recomputed: Redis could not answer in time
            first = t
            # Once Redis answers, a request is served from it, still off the thread.
            t = threading.Thread(target=lambda: outs.append(engine.generate([prompt(2)], SP)))
            t.start()
            t.join(timeout=60)
            assert not t.is_alive()
            assert outs[1] == [ref[2]]
            assert reply_threads  # Redis was read, by other threads only
            assert all(th is not first and th is not t for th in reply_threads)
            engine.drain()
    finally:
        proxy.close()


def test_a_server_that_never_answers_delays_admission_by_the_bound_only(
    redis_server: RedisServer,
) -> None:
    ref = fill(redis_server.url, 4)
    proxy = GatedProxy(redis_server.port)
    try:
        with LLMEngine(EngineConfig(redis_url=proxy.url, **KW)) as engine:
            log = DeferralLog(engine)
            outs: list[list[list[int]]] = []
            ps = [prompt(i) for i in range(4)]
            t = threading.Thread(target=lambda: outs.append(engine.generate(ps, SP)))
            with proxy.hold():
                t.start()
                t.join(timeout=60)
                assert not t.is_alive(), "admission waited for Redis"
            assert outs == [ref]
            assert len(log.admitted) == 4
            assert log.deferred and max(log.deferred.values()) <= MAX_LOOKUP_DEFER_STEPS
    finally:
        proxy.close()
