import hashlib

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvoffload.hashing as hashing
from kvoffload.hashing import (
    BlockHasher,
    block_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
    hash_request_tokens,
    init_none_hash,
    make_none_hash,
    resolve_none_hash_seed,
    sha256,
    sha256_cbor,
    xxhash64,
    xxhash128,
    xxhash128_cbor,
)
from kvoffload.hashing.block_hash import DEFAULT_NONE_HASH_SEED

FNS = [sha256, sha256_cbor, xxhash128, xxhash128_cbor, xxhash64]


def test_sha256_cbor_is_canonical_cbor_sha256() -> None:
    obj = (b"\x01" * 32, (1, 2, 3), None)
    assert sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@pytest.mark.parametrize("fn", FNS)
def test_same_input_same_hash(fn) -> None:
    assert hash_block_tokens(fn, b"p", [1, 2, 3]) == hash_block_tokens(fn, b"p", (1, 2, 3))


@pytest.mark.parametrize("fn", FNS)
def test_any_change_changes_hash(fn) -> None:
    base = hash_block_tokens(fn, b"parent", [1, 2, 3, 4], ("lora",))
    assert hash_block_tokens(fn, b"parenT", [1, 2, 3, 4], ("lora",)) != base
    assert hash_block_tokens(fn, b"parent", [1, 2, 3, 5], ("lora",)) != base
    assert hash_block_tokens(fn, b"parent", [1, 2, 3, 4], ("lorb",)) != base
    assert hash_block_tokens(fn, b"parent", [1, 2, 3, 4], None) != base


@pytest.mark.parametrize("fn", FNS)
def test_lora_and_salt_separate_chains(fn) -> None:
    toks = list(range(32))
    plain = hash_request_tokens(toks, 8, fn)
    lora = hash_request_tokens(toks, 8, fn, lora_name="a")
    salted = hash_request_tokens(toks, 8, fn, cache_salt="tenant1")
    salted2 = hash_request_tokens(toks, 8, fn, cache_salt="tenant2")
    assert not set(plain) & set(lora)
    assert not set(plain) & set(salted)
    assert not set(salted) & set(salted2)


def test_extra_keys_are_tagged_salt_only_on_first_block() -> None:
    assert block_extra_keys(0, None, "s") == (("cache_salt", "s"),)
    assert block_extra_keys(1, None, "s") is None
    assert block_extra_keys(3, "l", "s", "/p") == (("lora", "l", "/p"),)
    assert block_extra_keys(0, "l", "s", "/p") == (("lora", "l", "/p"), ("cache_salt", "s"))
    assert block_extra_keys(0, None, "") is None  # an empty salt is no salt
    assert block_extra_keys(0, None, None) is None


def test_lora_path_changes_the_chain() -> None:
    toks = list(range(16))
    a = hash_request_tokens(toks, 8, sha256, lora_name="l", lora_path="/a")
    b = hash_request_tokens(toks, 8, sha256, lora_name="l", lora_path="/b")
    assert not set(a) & set(b)


def test_chain_first_block_uses_none_hash() -> None:
    toks = [5, 6]
    direct = sha256_cbor((hashing.NONE_HASH, (5, 6), None))
    assert hash_block_tokens(sha256_cbor, None, toks) == direct


def test_partial_block_not_hashed() -> None:
    assert len(hash_request_tokens(list(range(15)), 8)) == 1
    assert hash_request_tokens([1, 2, 3], 8) == []


@given(
    st.lists(st.integers(0, 50_000), max_size=80),
    st.lists(st.integers(1, 20), max_size=10),
    st.sampled_from(FNS),
)
def test_incremental_equals_full_recompute(tokens, cuts, fn) -> None:
    hasher = BlockHasher(4, fn, lora_name="x", cache_salt="y")
    upto = 0
    all_new = []
    for c in cuts:
        upto = min(len(tokens), upto + c)
        all_new += hasher.update(tokens[:upto])
    all_new += hasher.update(tokens)
    full = hash_request_tokens(tokens, 4, fn, lora_name="x", cache_salt="y")
    assert all_new == full == hasher.block_hashes


def test_none_hash_seeded_is_reproducible(monkeypatch) -> None:
    assert make_none_hash(sha256_cbor, "42") == make_none_hash(sha256_cbor, "42")
    assert make_none_hash(sha256_cbor, "42") != make_none_hash(sha256_cbor, "43")
    assert make_none_hash("sha256", "42") == sha256("42")  # by name too


@pytest.mark.parametrize("fn", [sha256, sha256_cbor])
def test_crypto_none_hash_unseeded_is_the_fixed_default(monkeypatch, fn) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert resolve_none_hash_seed(fn) == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert make_none_hash(fn) == make_none_hash(fn) == fn("vllm-none-hash")


@pytest.mark.parametrize("fn", [xxhash128, xxhash128_cbor, xxhash64])
def test_non_crypto_none_hash_unseeded_is_random(monkeypatch, fn) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert make_none_hash(fn) != make_none_hash(fn)
    assert len(make_none_hash(fn)) == len(fn("x"))


@pytest.mark.parametrize("fn", FNS)
def test_env_seed_then_explicit_seed(monkeypatch, fn) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert make_none_hash(fn) == fn("123")
    assert make_none_hash(fn, "9") == fn("9")  # an explicit seed wins


def test_init_none_hash_updates_module_value() -> None:
    old = hashing.NONE_HASH
    try:
        h = init_none_hash(sha256_cbor, "7")
        assert hashing.NONE_HASH == h == sha256_cbor("7")
    finally:
        import kvoffload.hashing.block_hash as bh

        bh.NONE_HASH = old


def test_get_hash_fn_by_name() -> None:
    assert get_hash_fn_by_name("xxhash64") is xxhash64
    assert get_hash_fn_by_name("sha256") is sha256
    assert get_hash_fn_by_name("xxhash") is xxhash128
    assert get_hash_fn_by_name("xxhash_cbor") is xxhash128_cbor
    with pytest.raises(ValueError, match="known: sha256, sha256_cbor, xxhash, xxhash64"):
        get_hash_fn_by_name("md5")


def test_sha256_is_pickle_sha256_and_xxhash_is_128_bit() -> None:
    import pickle

    obj = (b"\x01" * 32, (1, 2, 3), (("lora", "a", "/p"),))
    assert sha256(obj) == hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()
    assert len(xxhash128(obj)) == len(xxhash128_cbor(obj)) == 16


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)


def test_xxhash64_is_8_bytes_and_generic_objects_work() -> None:
    assert len(xxhash64((b"a", (1,), None))) == 8
    assert xxhash64("seed") == xxhash64("seed")


def test_none_hash_seed_is_random(monkeypatch) -> None:
    from kvoffload.hashing import none_hash_seed_is_random

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash_seed_is_random("xxhash64") and none_hash_seed_is_random(xxhash128)
    assert not none_hash_seed_is_random("sha256")
    assert not none_hash_seed_is_random("xxhash", "5")
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert not none_hash_seed_is_random("xxhash_cbor")
