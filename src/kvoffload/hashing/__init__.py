"""Chained block hashes over token ids (+ extra keys: LoRA, salt), as vLLM 0.33 hashes them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports
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

if TYPE_CHECKING:
    from kvoffload.hashing.block_hash import NONE_HASH

# NONE_HASH can be re-seeded at run time (``init_none_hash`` rebinds it in
# block_hash): it is read there at each access, never kept as a stale copy.
__getattr__ = lazy_exports(__name__, {"NONE_HASH": "kvoffload.hashing.block_hash"})


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
