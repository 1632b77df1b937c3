"""Chained block hashes over token ids (+ extra keys: LoRA, salt)."""

from kvoffload.hashing import block_hash as _block_hash
from kvoffload.hashing.block_hash import (
    HASH_FUNCTIONS,
    BlockHash,
    BlockHasher,
    HashFunction,
    block_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
    hash_request_tokens,
    init_none_hash,
    make_none_hash,
    sha256_cbor,
    xxhash64,
)


def __getattr__(name: str) -> object:
    # NONE_HASH can be re-seeded at run time; read it live, not as a stale copy.
    if name == "NONE_HASH":
        return _block_hash.NONE_HASH
    raise AttributeError(name)


__all__ = [
    "HASH_FUNCTIONS",
    "NONE_HASH",
    "BlockHash",
    "BlockHasher",
    "HashFunction",
    "block_extra_keys",
    "get_hash_fn_by_name",
    "hash_block_tokens",
    "hash_request_tokens",
    "init_none_hash",
    "make_none_hash",
    "sha256_cbor",
    "xxhash64",
]
