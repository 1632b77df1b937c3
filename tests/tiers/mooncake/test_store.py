"""The Mooncake store's contract, as the Redis store's: bytes, presence, namespaces, bad values.

Against a real ``mooncake_master`` and a segment-holder process on loopback:
every byte crosses TCP from this process (a pure client) to the holder.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.tiers.mooncake.required import need_mooncake

need_mooncake()

from kvoffload.tiers.mooncake.client import MooncakeClient  # noqa: E402
from kvoffload.tiers.mooncake.store import HEADER_BYTES, MooncakeBlockStore  # noqa: E402
from tests.tiers.mooncake.cluster import LoopbackMooncake  # noqa: E402
from tests.tiers.mooncake.conftest import open_store  # noqa: E402

BLOCK = 4096


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") for i in range(n)]


@pytest.fixture
def raw(client: MooncakeClient) -> MooncakeClient:
    """A client that writes objects as another (broken) engine would."""
    return client


@pytest.fixture
def store(mooncake: LoopbackMooncake, client: MooncakeClient) -> Iterator[MooncakeBlockStore]:
    s = open_store(mooncake, BLOCK, client=client)
    yield s
    s.close()


def put_raw(raw: MooncakeClient, key: str, value: bytes) -> None:
    """Replace ``key``'s object with ``value`` (forced remove, then put)."""
    raw.batch_remove([key], True)
    buf = np.frombuffer(bytearray(value), dtype=np.uint8)
    assert raw.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    try:
        assert raw.batch_upsert_from([key], [buf.ctypes.data], [buf.nbytes]) == [0]
    finally:
        raw.unregister_buffer(buf.ctypes.data)


def test_round_trip_and_presence(store: MooncakeBlockStore) -> None:
    data, ks = blocks(6), keys(6)
    written = store.stats.blocks_written
    assert store.put(ks, data) == [True] * 6
    assert store.contains_many([*ks, b"absent!!"]) == [True] * 6 + [False]
    out = np.zeros_like(data)
    assert store.get_into(ks, out) == [True] * 6
    assert (out == data).all()
    assert all(g is None for g in store.get([b"absent!!"]))
    assert store.stats.blocks_written - written == 6 and store.stats.blocks_read == 6


def test_put_is_put_if_absent_and_equal_bytes_are_kept(store: MooncakeBlockStore) -> None:
    ks = keys(2, 100)
    assert store.put(ks, blocks(2, 1)) == [True, True]
    assert store.put(ks, blocks(2, 1)) == [True, True]  # same key, same bytes: accepted
    got = store.get(ks)
    assert all(g is not None and (g == b).all() for g, b in zip(got, blocks(2, 1)))


def test_namespaces_and_fingerprints_never_meet(
    mooncake: LoopbackMooncake, client: MooncakeClient
) -> None:
    a = open_store(mooncake, BLOCK, namespace="shared")  # a client of its own: another engine
    b = open_store(mooncake, BLOCK, namespace="shared", client=client)
    other_model = open_store(
        mooncake, BLOCK, namespace="shared", geometry_fingerprint="model=b", client=client
    )
    other_ns = open_store(mooncake, BLOCK, namespace="elsewhere", client=client)
    try:
        ks = keys(3, 200)
        assert a.put(ks, blocks(3, 2)) == [True] * 3
        assert b.contains_many(ks) == [True] * 3  # same fingerprint and namespace: shared
        assert other_model.contains_many(ks) == [False] * 3
        assert all(g is None for g in other_ns.get(ks))
        assert a.ownership == b.ownership != other_model.ownership
        assert a.ownership.startswith("mooncake:shared:")
    finally:
        for s in (a, b, other_model, other_ns):
            s.close()


def test_a_corrupt_value_is_a_miss_then_rewritten(
    store: MooncakeBlockStore, raw: MooncakeClient
) -> None:
    """A value of the right size with a wrong checksum: a miss, removed, and the next
    put (an upsert: Mooncake's put would keep the bad value) makes it a hit again."""
    (k,), data = keys(1, 300), blocks(1, 3)
    assert store.put([k], data) == [True]
    okey = store.object_key(k)
    flipped = bytearray(store_value(store, k, data[0]))
    flipped[-1] ^= 0xFF
    put_raw(raw, okey, bytes(flipped))
    assert all(g is None for g in store.get([k]))
    assert store.stats.corrupt_values == 1
    assert store.contains_many([k]) == [False]  # removed, not left for the next engine
    assert store.put([k], data) == [True]
    got = store.get([k])[0]
    assert got is not None and (got == data[0]).all()
    assert store.stats.upserts == 1


def store_value(store: MooncakeBlockStore, key: bytes, payload: np.ndarray) -> bytes:
    """The exact value ``store`` writes for ``key`` (header + payload)."""
    from kvoffload.tiers.mooncake.values import checksum, pack_header

    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    pack_header(header, store.block_bytes, checksum(store.object_key(key), payload))
    return header.tobytes() + payload.tobytes()


@pytest.mark.parametrize("size", [HEADER_BYTES + BLOCK // 2, HEADER_BYTES + 2 * BLOCK, 7])
def test_a_value_of_the_wrong_size_is_a_clean_miss(
    store: MooncakeBlockStore, raw: MooncakeClient, size: int
) -> None:
    """Under our namespace but shorter or longer than our values: a miss (the caller's
    buffer is not reported filled), the object is removed, and a put then lands."""
    (k,), data = keys(1, 400 + size), blocks(1, 4)
    value = (store_value(store, k, data[0]) * 3)[:size]
    put_raw(raw, store.object_key(k), value)
    out = np.full((1, BLOCK), 7, dtype=np.uint8)
    assert store.get_into([k], out) == [False]
    assert (out == 7).all()  # a miss leaves the caller's buffer alone
    assert store.contains_many([k]) == [False]
    assert store.put([k], data) == [True]
    got = store.get([k])[0]
    assert got is not None and (got == data[0]).all()


def test_remove_is_forced_past_a_readers_lease(store: MooncakeBlockStore) -> None:
    ks = keys(2, 500)
    store.put(ks, blocks(2, 5))
    assert store.get(ks)[0] is not None  # a get takes a lease: a plain remove would fail
    assert store.remove(ks) == 2
    assert store.contains_many(ks) == [False, False]


def test_clear_removes_only_this_prefix(mooncake: LoopbackMooncake, client: MooncakeClient) -> None:
    a = open_store(mooncake, BLOCK, client=client)
    b = open_store(mooncake, BLOCK, client=client)
    try:
        ks = keys(3, 600)
        a.put(ks, blocks(3, 6))
        b.put(ks, blocks(3, 6))
        assert a.clear() == 3
        assert a.contains_many(ks) == [False] * 3
        assert b.contains_many(ks) == [True] * 3
    finally:
        a.close()
        b.close()
