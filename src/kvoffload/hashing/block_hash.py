"""Chained content hashes of full token blocks.

The hash of block ``i`` covers its tokens, its extra keys and the hash of
block ``i - 1``, so equal hashes mean equal prefixes: that is what makes a
block reusable by any later request that shares the prefix. The first block
of a chain takes ``NONE_HASH`` as its parent.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2
import xxhash

BlockHash = NewType("BlockHash", bytes)
HashFunction = Callable[[Any], bytes]


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj``.

    The scheme vLLM and llm-d use for ``(parent, tokens, extra_keys)``, so the
    same seed gives the same hashes there and here.
    """
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_COUNT = struct.Struct("<I")


def xxhash64(obj: Any) -> bytes:
    """Fast 64-bit hash (xxh3) for single-instance deployments.

    ``(parent, tokens, extra)`` triples take a packed fast path (length-prefixed
    so no two triples encode alike); anything else goes through canonical CBOR.
    64 bits keep collisions negligible below billions of distinct blocks; use
    ``sha256_cbor`` where hashes are shared across instances.
    """
    if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], bytes):
        parent, tokens, extra = obj
        h = xxhash.xxh3_64()
        h.update(_COUNT.pack(len(parent)))
        h.update(parent)
        h.update(_COUNT.pack(len(tokens)))
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        if extra is not None:
            h.update(cbor2.dumps(extra, canonical=True))
        return h.digest()
    return xxhash.xxh3_64_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, HashFunction] = {"sha256_cbor": sha256_cbor, "xxhash64": xxhash64}


def get_hash_fn_by_name(name: str) -> HashFunction:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(HASH_FUNCTIONS))
        raise ValueError(f"unknown hash function {name!r}; known: {known}") from None


def make_none_hash(hash_fn: HashFunction, seed: str | None = None) -> BlockHash:
    """The parent hash of every chain's first block.

    With a seed (or ``PYTHONHASHSEED`` set) it is ``hash_fn(seed)``, so processes
    that share the seed share hashes; otherwise it is random per process, which
    keeps unrelated processes from colliding on purpose-built prefixes.
    """
    if seed is None:
        seed = os.getenv("PYTHONHASHSEED")
    if seed is None:
        return BlockHash(os.urandom(32))
    return BlockHash(hash_fn(seed))


NONE_HASH: BlockHash = make_none_hash(sha256_cbor)


def init_none_hash(hash_fn: HashFunction, seed: str | None = None) -> BlockHash:
    """Reset the module-wide ``NONE_HASH`` (for example after choosing a hash fn)."""
    global NONE_HASH
    NONE_HASH = make_none_hash(hash_fn, seed)
    return NONE_HASH


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_block_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (None for a chain's first)."""
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return BlockHash(hash_fn((parent_block_hash, tuple(token_ids), extra_keys)))


def block_extra_keys(
    block_index: int, lora_name: str | None, cache_salt: str | None
) -> tuple[Any, ...] | None:
    """Extra keys of a block: the LoRA adapter on every block, the salt on the first.

    The salt only needs to be on the first block: it then changes every hash
    down the chain.
    """
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    if cache_salt is not None and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


class BlockHasher:
    """Incremental hasher of one request's full blocks.

    ``update(token_ids)`` takes the request's whole token list so far and hashes
    only the blocks that became full since the last call; the result equals
    hashing every block from scratch.
    """

    __slots__ = ("block_hashes", "block_size", "cache_salt", "hash_fn", "lora_name", "parent")

    def __init__(
        self,
        block_size: int,
        hash_fn: HashFunction = sha256_cbor,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        parent: bytes | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.parent = parent
        self.block_hashes: list[BlockHash] = []

    def update(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hash newly full blocks of ``token_ids``; returns only the new hashes."""
        bs = self.block_size
        start = len(self.block_hashes)
        end = len(token_ids) // bs
        new: list[BlockHash] = []
        parent = self.block_hashes[-1] if self.block_hashes else self.parent
        for i in range(start, end):
            extra = block_extra_keys(i, self.lora_name, self.cache_salt)
            parent = hash_block_tokens(
                self.hash_fn, parent, token_ids[i * bs : (i + 1) * bs], extra
            )
            new.append(parent)
        self.block_hashes.extend(new)
        return new


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFunction = sha256_cbor,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (the partial tail is left out)."""
    return BlockHasher(block_size, hash_fn, lora_name, cache_salt).update(token_ids)
