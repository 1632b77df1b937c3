"""Chained content hashes of full token blocks, in vLLM 0.33's scheme.

The hash of block ``i`` covers its tokens, its extra keys and the hash of
block ``i - 1``, so equal hashes mean equal prefixes: that is what makes a
block reusable by any later request that shares the prefix. The first block
of a chain takes ``NONE_HASH`` (a hash of the *seed*) as its parent.

Compatibility with vLLM 0.33 (checked against its own code in
``tests/compat/test_vllm_hashes.py``): for the same hash function name,
seed, tokens and extra keys, every block hash here equals vLLM's:

- hash functions of the same names: ``sha256`` (pickle, vLLM's default),
  ``sha256_cbor``, ``xxhash`` and ``xxhash_cbor`` (xxh3-128); plus
  ``xxhash64`` (xxh3-64), which vLLM does not have;
- the hashed object is ``(parent_hash, tuple(token_ids), extra_keys)``;
- extra keys are tagged by source: ``("lora", name, path)`` on every block
  of a LoRA request, then ``("cache_salt", salt)`` on the first block only
  (a non-empty salt); ``None`` when there are none. vLLM's other sources
  (multimodal items, prompt embeddings, speculative look-ahead tokens) have
  no input here;
- the seed: an explicit one wins (the engine's ``hash_seed``), then
  ``PYTHONHASHSEED``, then, for collision-resistant functions, the fixed
  ``DEFAULT_NONE_HASH_SEED``; non-cryptographic functions get a random seed
  per process instead (a predictable seed would let anyone precompute
  colliding blocks). So two processes that set nothing share hashes with
  ``sha256``/``sha256_cbor`` and do not with the xxhash family.

``sha256`` and ``xxhash`` hash a pickle, so they are only reproducible
between Python processes that share the highest pickle protocol (5 from
CPython 3.8 on); pickle also writes a string that occurs twice *as the same
object* (say a LoRA name passed again as its path) as a back-reference, so
such a pair hashes alike only where both sides alias it alike. The
``_cbor`` functions have neither caveat and are language-neutral.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2
import xxhash as _xxh

BlockHash = NewType("BlockHash", bytes)
HashFunction = Callable[[Any], bytes]

#: The seed of ``NONE_HASH`` for collision-resistant hash functions when none
#: is given and ``PYTHONHASHSEED`` is unset: vLLM 0.33's, so both agree.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

#: The environment variable that seeds ``NONE_HASH`` (as in vLLM).
SEED_ENV_VAR = "PYTHONHASHSEED"

#: The hash function both kvoffload and vLLM 0.33 use by default.
DEFAULT_HASH_FN = "sha256"


def sha256(obj: Any) -> bytes:
    """SHA-256 of ``obj``'s highest-protocol pickle (vLLM's default ``sha256``)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj``.

    Language-neutral: what vLLM calls ``sha256_cbor``, and what llm-d
    recomputes from events.
    """
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash128(obj: Any) -> bytes:
    """xxh3-128 of ``obj``'s highest-protocol pickle (vLLM's ``xxhash``)."""
    return _xxh.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash128_cbor(obj: Any) -> bytes:
    """xxh3-128 of ``obj``'s canonical CBOR (vLLM's ``xxhash_cbor``)."""
    return _xxh.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_COUNT = struct.Struct("<I")


def xxhash64(obj: Any) -> bytes:
    """Fast 64-bit hash (xxh3) for single-instance deployments; no vLLM counterpart.

    ``(parent, tokens, extra)`` triples take a packed fast path (length-prefixed
    so no two triples encode alike); anything else goes through canonical CBOR.
    64 bits keep collisions negligible below billions of distinct blocks; use
    ``sha256`` where hashes are shared across instances or with vLLM.
    """
    if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], bytes):
        parent, tokens, extra = obj
        h = _xxh.xxh3_64()
        h.update(_COUNT.pack(len(parent)))
        h.update(parent)
        h.update(_COUNT.pack(len(tokens)))
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        if extra is not None:
            h.update(cbor2.dumps(extra, canonical=True))
        return h.digest()
    return _xxh.xxh3_64_digest(cbor2.dumps(obj, canonical=True))


#: By the names vLLM uses (``--prefix-caching-hash-algo``), plus ``xxhash64``.
HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash128,
    "xxhash_cbor": xxhash128_cbor,
    "xxhash64": xxhash64,
}

#: Not collision resistant: their NONE_HASH seed must stay unpredictable.
NON_CRYPTO_HASH_FUNCTIONS: frozenset[HashFunction] = frozenset(
    {xxhash128, xxhash128_cbor, xxhash64}
)


def get_hash_fn_by_name(name: str) -> HashFunction:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(HASH_FUNCTIONS))
        raise ValueError(f"unknown hash function {name!r}; known: {known}") from None


def _as_hash_fn(hash_fn: str | HashFunction) -> HashFunction:
    return get_hash_fn_by_name(hash_fn) if isinstance(hash_fn, str) else hash_fn


def resolve_none_hash_seed(hash_fn: str | HashFunction, seed: str | None = None) -> str:
    """The seed ``NONE_HASH`` is derived from (see the module docstring for the order)."""
    if seed is not None:
        return seed
    env = os.getenv(SEED_ENV_VAR)
    if env is not None:
        return env
    if _as_hash_fn(hash_fn) in NON_CRYPTO_HASH_FUNCTIONS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def none_hash_seed_is_random(hash_fn: str | HashFunction, seed: str | None = None) -> bool:
    """Whether ``resolve_none_hash_seed(hash_fn, seed)`` draws a fresh random seed.

    Then no other process (nor this one after a restart) shares the chain's
    hashes, so persistent tiers cannot serve its blocks later.
    """
    return (
        seed is None
        and os.getenv(SEED_ENV_VAR) is None
        and _as_hash_fn(hash_fn) in NON_CRYPTO_HASH_FUNCTIONS
    )


def make_none_hash(hash_fn: str | HashFunction, seed: str | None = None) -> BlockHash:
    """The parent hash of every chain's first block: ``hash_fn(resolved seed)``.

    ``hash_fn`` is a function or its name. ``seed=None`` resolves as vLLM
    does (``PYTHONHASHSEED``, else the fixed default for sha256 functions,
    else random per process); an explicit seed acts as ``PYTHONHASHSEED``
    set to it would in vLLM.
    """
    fn = _as_hash_fn(hash_fn)
    return BlockHash(fn(resolve_none_hash_seed(fn, seed)))


NONE_HASH: BlockHash = make_none_hash(sha256)


def init_none_hash(hash_fn: str | HashFunction, seed: str | None = None) -> BlockHash:
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
    block_index: int,
    lora_name: str | None,
    cache_salt: str | None,
    lora_path: str | None = None,
) -> tuple[Any, ...] | None:
    """Extra keys of block ``block_index``, tagged by source as vLLM 0.33 tags them.

    ``("lora", lora_name, lora_path)`` on every block of a LoRA request (the
    path too, so re-pointing a name at another adapter does not reuse its
    KV; vLLM always has a path, so a LoRA hash without one matches no vLLM
    hash), then ``("cache_salt", salt)`` on the first block only: it changes
    every hash down the chain from there. An empty salt is no salt.
    """
    keys: list[tuple[Any, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's extra keys as KV events carry them: untagged, as vLLM 0.33 publishes.

    A tagged key loses its tag (``("lora", name, path)`` -> ``name``,
    ``("cache_salt", salt)`` -> ``salt``), except multimodal ones, which keep
    their ``(identifier, offset)`` pair. The block hash itself uses the tagged form.
    """
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


class BlockHasher:
    """Incremental hasher of one request's full blocks.

    ``update(token_ids)`` takes the request's whole token list so far and hashes
    only the blocks that became full since the last call; the result equals
    hashing every block from scratch. ``parent``: the chain's seed hash (the
    engine's ``make_none_hash``); None takes the module's ``NONE_HASH``.
    """

    __slots__ = (
        "block_hashes",
        "block_size",
        "cache_salt",
        "hash_fn",
        "lora_name",
        "lora_path",
        "parent",
    )

    def __init__(
        self,
        block_size: int,
        hash_fn: HashFunction = sha256,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        parent: bytes | None = None,
        lora_path: str | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.lora_name = lora_name
        self.lora_path = lora_path
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
            extra = block_extra_keys(i, self.lora_name, self.cache_salt, self.lora_path)
            parent = hash_block_tokens(
                self.hash_fn, parent, token_ids[i * bs : (i + 1) * bs], extra
            )
            new.append(parent)
        self.block_hashes.extend(new)
        return new


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFunction = sha256,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    lora_path: str | None = None,
    parent: bytes | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (the partial tail is left out)."""
    hasher = BlockHasher(block_size, hash_fn, lora_name, cache_salt, parent, lora_path)
    return hasher.update(token_ids)
