"""The Mooncake tier's values and keys: header, checksum, namespace prefix.

Value: a 16-byte header (magic, format version, payload length, xxh3-64 of
the object key + payload) then the payload. Key prefix:
``kvo/<namespace>/<digest>/``, the digest covering the tier fingerprint, the
block size and this format's version (``MooncakeBlockStore``'s docstring).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import xxhash

FORMAT_VERSION = 1
_MAGIC = b"KVM1"
# magic, version, pad, payload length, checksum of key + payload
_HEADER = struct.Struct("<4sBxxxIQ")
HEADER_BYTES = _HEADER.size


def namespace_prefix(
    namespace: str, block_bytes: int, geometry_fingerprint: str, hash_fn: str
) -> str:
    """The key prefix: namespace plus a digest of everything that makes blocks compatible."""
    if not namespace or "/" in namespace:
        raise ValueError(f"the Mooncake namespace must be non-empty without '/', got {namespace!r}")
    ident = json.dumps(
        {
            "store": "mooncake",
            "version": FORMAT_VERSION,
            "block_bytes": block_bytes,
            "geometry": geometry_fingerprint,
            "hash_fn": hash_fn,
        },
        sort_keys=True,
    )
    return f"kvo/{namespace}/{xxhash.xxh3_64_hexdigest(ident.encode())}/"


def checksum(key: str, payload: Any) -> int:
    h = xxhash.xxh3_64()
    h.update(key.encode())
    h.update(payload)
    return h.intdigest()


def pack_header(header: Any, block_bytes: int, csum: int) -> None:
    _HEADER.pack_into(header, 0, _MAGIC, FORMAT_VERSION, block_bytes, csum)


def unpack_header(header: Any) -> tuple[bytes, int, int, int]:
    magic, version, length, csum = _HEADER.unpack_from(header, 0)
    return magic, version, length, csum


def verify(okey: str, header: Any, payload: Any, block_bytes: int) -> bool:
    """Whether ``header`` + ``payload`` are this format's value of ``okey`` (checksum too)."""
    magic, version, length, csum = unpack_header(header)
    if magic != _MAGIC or version != FORMAT_VERSION or length != block_bytes:
        return False
    return checksum(okey, payload) == csum
