"""Chained block hashes over token ids (+ extra keys: LoRA, salt), as vLLM 0.33 hashes them."""

from kvoffload.hashing import block_hash as _block_hash
from kvoffload.hashing.block_hash import (
    DEFAULT_HASH_FN,
    DEFAULT_NONE_HASH_SEED,
    HASH_FUNCTIONS,
    NON_CRYPTO_HASH_FUNCTIONS,
    SEED_ENV_VAR,
    BlockHash,
    BlockHasher,
    HashFunction,
    block_extra_keys,
    event_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
    hash_request_tokens,
    init_none_hash,
    make_none_hash,
    none_hash_seed_is_random,
    resolve_none_hash_seed,
    sha256,
    sha256_cbor,
    xxhash64,
    xxhash128,
    xxhash128_cbor,
)


def __getattr__(name: str) -> object:
    # NONE_HASH can be re-seeded at run time; read it live, not as a stale copy.
    if name == "NONE_HASH":
        return _block_hash.NONE_HASH
    raise AttributeError(name)


__all__ = [
    "DEFAULT_HASH_FN",
    "DEFAULT_NONE_HASH_SEED",
    "HASH_FUNCTIONS",
    "NONE_HASH",
    "NON_CRYPTO_HASH_FUNCTIONS",
    "SEED_ENV_VAR",
    "BlockHash",
    "BlockHasher",
    "HashFunction",
    "block_extra_keys",
    "event_extra_keys",
    "get_hash_fn_by_name",
    "hash_block_tokens",
    "hash_request_tokens",
    "init_none_hash",
    "make_none_hash",
    "none_hash_seed_is_random",
    "resolve_none_hash_seed",
    "sha256",
    "sha256_cbor",
    "xxhash64",
    "xxhash128",
    "xxhash128_cbor",
]
