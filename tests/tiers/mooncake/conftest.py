"""Fixtures for the Mooncake tier's tests: a loopback master and holder (``cluster``).

Each test module starts with ``need_mooncake()`` (``required``); nothing here
imports the wheel.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.tiers.mooncake.client import (
    MooncakeClient,
    is_down_code,
    open_client,
    parse_master_url,
)
from kvoffload.tiers.mooncake.store import MooncakeBlockStore
from tests.tiers.mooncake.cluster import LoopbackMooncake

_NAMES = itertools.count()


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackMooncake]:
    """One master and one 128 MiB segment holder for every test that does not kill them
    (each test stores under a namespace of its own)."""
    cluster = LoopbackMooncake(tmp_path_factory.mktemp("mooncake"))
    try:
        cluster.add_holder(128 << 20)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def client(mooncake: LoopbackMooncake) -> Iterator[MooncakeClient]:
    """One pure client of the module's cluster, shared by its stores (closing one costs ~1 s)."""
    c = open_client(parse_master_url(mooncake.url))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def fresh_mooncake(tmp_path: Path) -> Iterator[LoopbackMooncake]:
    """A master of this test's own (faults kill it), no holder yet."""
    cluster = LoopbackMooncake(tmp_path / "mooncake")
    try:
        yield cluster
    finally:
        cluster.close()


def wait_for_room(store: MooncakeBlockStore, timeout_s: float = 10.0) -> None:
    """Until a put lands: a holder's segment is mounted a moment after it listens."""
    probe = np.zeros(store.block_bytes, dtype=np.uint8)
    key = f"room-{next(_NAMES)}".encode()
    deadline = time.monotonic() + timeout_s
    while not store.put([key], probe[None])[0]:
        if time.monotonic() > deadline:
            raise RuntimeError("no segment accepted a put: is a holder running?")
        time.sleep(0.05)
    store.remove([key])


def open_store(cluster: LoopbackMooncake, block_bytes: int = 4096, **kw: Any) -> MooncakeBlockStore:
    """A pure-client store in a namespace of its own, once the pool takes puts."""
    kw.setdefault("geometry_fingerprint", "test-geometry")
    namespace = kw.pop("namespace", f"t{next(_NAMES)}")
    store = MooncakeBlockStore(cluster.url, namespace, block_bytes, **kw)
    if cluster.holders:
        wait_for_room(store)
    return store


def wait_until(cond: Any, timeout_s: float = 15.0, step_s: float = 0.02) -> bool:
    """Poll ``cond()`` until true or ``timeout_s`` (no assertion on the time it took)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True


class CountingClient:
    """A client that counts the calls that reached it (and the down codes they answered)."""

    def __init__(self, inner: MooncakeClient) -> None:
        self.inner = inner
        self.calls = 0
        self.down_answers = 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if not name.startswith("batch_"):
            return fn

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            out = fn(*args, **kwargs)
            if isinstance(out, list) and any(is_down_code(int(c)) for c in out):
                self.down_answers += 1
            return out

        return counted
