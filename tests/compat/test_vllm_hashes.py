"""kvoffload's block hashes equal vLLM 0.33's, computed by vLLM's own code.

vLLM side: ``get_hash_fn_by_name``, ``init_none_hash`` (which reads
``PYTHONHASHSEED`` when it is called, not at import, so the tests set it in
process), ``get_request_block_hasher`` driving real ``vllm.v1.request.Request``
objects (with ``LoRARequest`` and ``cache_salt``), and ``hash_block_tokens``.
"""

from tests.vllm_required import need_vllm

need_vllm()

import random  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name as vllm_hash_fn  # noqa: E402
from vllm.v1.core import kv_cache_utils as vku  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402

from kvoffload.hashing import (  # noqa: E402
    DEFAULT_HASH_FN,
    BlockHasher,
    block_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
    make_none_hash,
)

ALL_FNS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
CRYPTO_FNS = ["sha256", "sha256_cbor"]
BLOCK_SIZES = [1, 4, 16, 64]
LORAS = [None, ("adapter-a", 7, "/models/lora/a"), ("adapter-b", 9, "hf://org/adapter-b")]
SALTS = [None, "", "tenant-1", "ünïcødé salt"]

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vllm_chain(
    fn_name: str,
    tokens: list[int],
    block_size: int,
    lora: tuple[str, int, str] | None,
    salt: str | None,
) -> list[bytes]:
    """vLLM's hashes of ``tokens``, after its NONE_HASH was initialised by the caller."""
    fn = vllm_hash_fn(fn_name)
    lora_req = LoRARequest(lora[0], lora[1], lora[2]) if lora else None
    req = VllmRequest(
        "r",
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        lora_request=lora_req,
        cache_salt=salt,
        block_hasher=vku.get_request_block_hasher(block_size, fn),
    )
    return list(req.block_hashes)


def our_chain(
    fn_name: str,
    tokens: list[int],
    block_size: int,
    lora: tuple[str, int, str] | None,
    salt: str | None,
    seed: str | None,
) -> list[bytes]:
    hasher = BlockHasher(
        block_size,
        get_hash_fn_by_name(fn_name),
        lora_name=lora[0] if lora else None,
        cache_salt=salt,
        parent=make_none_hash(fn_name, seed),
        lora_path=lora[2] if lora else None,
    )
    return hasher.update(tokens)


def test_default_hash_function_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.cache import CacheConfig

    default = CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default
    assert default == DEFAULT_HASH_FN == "sha256"
    from kvoffload.engine.config import EngineConfig

    assert EngineConfig().hash_fn == default


@pytest.mark.parametrize("fn_name", ALL_FNS)
def test_none_hash_with_env_seed(monkeypatch: pytest.MonkeyPatch, fn_name: str) -> None:
    for seed in ("0", "42", "a long shared seed"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        vku.init_none_hash(vllm_hash_fn(fn_name))
        assert make_none_hash(fn_name) == vku.NONE_HASH  # read from the env, as vLLM
        assert make_none_hash(fn_name, seed) == vku.NONE_HASH  # our explicit seed
        assert vku.get_none_hash_seed() == seed


@pytest.mark.parametrize("fn_name", CRYPTO_FNS)
def test_none_hash_unseeded_crypto_is_vllms_fixed_default(
    monkeypatch: pytest.MonkeyPatch, fn_name: str
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vku.init_none_hash(vllm_hash_fn(fn_name))
    assert make_none_hash(fn_name) == vku.NONE_HASH
    assert vku.get_none_hash_seed() == vku.DEFAULT_NONE_HASH_SEED


@pytest.mark.parametrize("fn_name", ["xxhash", "xxhash_cbor"])
def test_none_hash_unseeded_non_crypto_is_random_on_both_sides(
    monkeypatch: pytest.MonkeyPatch, fn_name: str
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vku.init_none_hash(vllm_hash_fn(fn_name))
    first = vku.NONE_HASH
    vku.init_none_hash(vllm_hash_fn(fn_name))
    assert first != vku.NONE_HASH
    assert make_none_hash(fn_name) != make_none_hash(fn_name)
    assert len(make_none_hash(fn_name)) == len(first)


@pytest.mark.parametrize("fn_name", ALL_FNS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@_SETTINGS
@given(
    tokens=st.lists(st.integers(0, 200_000), min_size=0, max_size=300),
    lora=st.sampled_from(LORAS),
    salt=st.sampled_from(SALTS),
    seed=st.sampled_from(["0", "1234", "shared"]),
)
def test_chains_equal_vllms_with_explicit_seed(
    fn_name: str, block_size: int, tokens: list[int], lora, salt, seed: str
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", seed)
        vku.init_none_hash(vllm_hash_fn(fn_name))
        expected = vllm_chain(fn_name, tokens, block_size, lora, salt)
    ours = our_chain(fn_name, tokens, block_size, lora, salt, seed)
    assert len(ours) == len(tokens) // block_size
    assert ours == expected


@pytest.mark.parametrize("fn_name", CRYPTO_FNS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@_SETTINGS
@given(
    tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=300),
    lora=st.sampled_from(LORAS),
    salt=st.sampled_from(SALTS),
)
def test_chains_equal_vllms_with_default_seed(
    fn_name: str, block_size: int, tokens: list[int], lora, salt
) -> None:
    """Nothing set on either side: sha256 hashes still agree (the fixed default seed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONHASHSEED", raising=False)
        vku.init_none_hash(vllm_hash_fn(fn_name))
        expected = vllm_chain(fn_name, tokens, block_size, lora, salt)
        ours = our_chain(fn_name, tokens, block_size, lora, salt, None)
    assert ours == expected


@pytest.mark.parametrize("fn_name", ALL_FNS)
def test_incremental_decode_hashes_equal_vllms(monkeypatch: pytest.MonkeyPatch, fn_name) -> None:
    """Blocks that fill during decoding hash alike (vLLM re-hashes on appended outputs)."""
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    fn = vllm_hash_fn(fn_name)
    vku.init_none_hash(fn)
    rng = random.Random(5)
    prompt = [rng.randrange(50_000) for _ in range(37)]
    req = VllmRequest(
        "r",
        list(prompt),
        SamplingParams(max_tokens=100),
        None,
        lora_request=LoRARequest("l", 3, "/l"),
        cache_salt="s",
        block_hasher=vku.get_request_block_hasher(8, fn),
    )
    ours = BlockHasher(8, get_hash_fn_by_name(fn_name), "l", "s", make_none_hash(fn_name), "/l")
    tokens = list(prompt)
    ours.update(tokens)
    for _ in range(60):
        t = rng.randrange(50_000)
        req.append_output_token_ids(t)
        tokens.append(t)
        ours.update(tokens)
    assert ours.block_hashes == list(req.block_hashes)
    assert len(ours.block_hashes) == len(tokens) // 8


@pytest.mark.parametrize("fn_name", ALL_FNS)
def test_hash_block_tokens_and_extra_keys_match(monkeypatch, fn_name: str) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    fn = vllm_hash_fn(fn_name)
    vku.init_none_hash(fn)
    ours_fn = get_hash_fn_by_name(fn_name)
    parent = make_none_hash(fn_name)
    req = VllmRequest(
        "r",
        list(range(32)),
        SamplingParams(max_tokens=1),
        None,
        lora_request=LoRARequest("n", 1, "/p"),
        cache_salt="salt",
    )
    for start in (0, 16):
        v_keys, _ = vku.generate_block_hash_extra_keys(req, start, start + 16, 0)
        o_keys = block_extra_keys(start // 16, "n", "salt", "/p")
        assert o_keys == v_keys
        tokens = list(range(start, start + 16))
        assert hash_block_tokens(ours_fn, parent, tokens, o_keys) == vku.hash_block_tokens(
            fn, None, tokens, v_keys
        )


@pytest.mark.parametrize("lora", LORAS)
@pytest.mark.parametrize("salt", SALTS)
def test_event_extra_keys_are_vllms_untagged_form(lora, salt) -> None:
    """A GPU ``BlockStored`` carries each block's extra keys as vLLM's block pool publishes them."""
    from kvoffload.blocks.block_pool import BlockPool
    from kvoffload.hashing import event_extra_keys

    block_size, num_blocks = 4, 3
    req = VllmRequest(
        "r",
        list(range(block_size * num_blocks)),
        SamplingParams(max_tokens=1),
        None,
        lora_request=LoRARequest(*lora) if lora else None,
        cache_salt=salt,
    )
    want = vku.to_event_extra_keys(
        [
            vku.generate_block_hash_extra_keys(req, i * block_size, (i + 1) * block_size, 0)[0]
            for i in range(num_blocks)
        ]
    )
    name, path = (lora[0], lora[2]) if lora else (None, None)
    ours = [event_extra_keys(block_extra_keys(i, name, salt, path)) for i in range(num_blocks)]
    assert ours == want

    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(num_blocks)
    hashes = [bytes([i]) * 32 for i in range(num_blocks)]
    pool.cache_full_blocks(
        blocks, hashes, 0, num_blocks, block_size, req.all_token_ids, None, name, salt
    )
    (event,) = pool.take_events()
    assert event.extra_keys == want
