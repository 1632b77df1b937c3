"""The remote tier's bytes: KV blocks as binary values in a shared Redis/Valkey server.

Key: ``kvo:<namespace>:<fingerprint>:`` + the block's key bytes, where the
fingerprint digests the geometry, the hash function, the block size and this
format's version: engines whose blocks are not interchangeable never see each
other's keys, engines that match share them (what one stores, another loads).

Value: a 16-byte header (magic, format version, payload length, xxh3-64 of
key + payload) then the payload. A value of the wrong length, magic or
checksum is a miss (and is deleted): a torn or foreign value never reaches a
caller's buffer as a hit.

Faults: every socket operation has a bounded timeout and at most one
immediate retry (a pooled connection gone stale across a server restart). A
connection failure trips a breaker: for ``retry_interval_s`` every call
answers at once (misses, failed stores, nothing present) without touching the
network; then one call probes again, and each probe that fails doubles the
wait (up to ``max_retry_interval_s``), so a server that swallows packets
costs the engine at most one timeout per interval. The outage is logged once when it
starts and once when the server is back. Server-side refusals (out of memory
under ``noeviction``, and the like) fail only the commands concerned.
Capacity and expiry are the server's business (``maxmemory``,
``maxmemory-policy``, ``ttl_s``).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvoffload.transfer.block_buffers import BlockBuffers, as_block_views

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"KVB1"
# magic, version, pad, payload length, checksum of key + payload
_HEADER = struct.Struct("<4sBxxxIQ")
HEADER_BYTES = _HEADER.size
_SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "unix": "unix",
    "valkey": "redis",
    "valkeys": "rediss",
}
_OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)

T = TypeVar("T")


class RedisStoreError(RuntimeError):
    """The remote tier cannot be used as configured (rejected credentials and the like)."""


@dataclass
class RedisStoreStats:
    blocks_written: int = 0
    blocks_read: int = 0
    store_failures: int = 0
    misses: int = 0
    corrupt_values: int = 0
    outages: int = 0
    calls_skipped: int = 0


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def normalize_url(url: str) -> str:
    """Check ``url`` and map ``valkey://`` to ``redis://``; a bad URL is a ``ValueError``."""
    if not isinstance(url, str) or not url:
        raise ValueError("the Redis URL is empty")
    shown = redact_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"bad Redis URL {shown!r}: {e}") from None
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        known = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ValueError(f"bad Redis URL {shown!r}: the scheme must be one of {known}")
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"bad Redis URL {shown!r}: a unix:// URL needs a socket path")
    else:
        if not parts.hostname:
            raise ValueError(f"bad Redis URL {shown!r}: no host")
        if port == 0:
            raise ValueError(f"bad Redis URL {shown!r}: port 0")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ValueError(f"bad Redis URL {shown!r}: the path must be a database number")
    # Only the scheme changes (urlunsplit would also drop unix://'s empty host).
    return scheme + url[len(parts.scheme) :]


def namespace_prefix(
    namespace: str, block_bytes: int, geometry_fingerprint: str, hash_fn: str
) -> bytes:
    """The key prefix: namespace plus a digest of everything that makes blocks compatible."""
    if not namespace:
        raise ValueError("the Redis namespace must not be empty")
    ident = json.dumps(
        {
            "version": FORMAT_VERSION,
            "block_bytes": block_bytes,
            "geometry": geometry_fingerprint,
            "hash_fn": hash_fn,
        },
        sort_keys=True,
    )
    return f"kvo:{namespace}:{xxhash.xxh3_64_hexdigest(ident.encode())}:".encode()


def _checksum(key: bytes, payload: Any) -> int:
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(payload)
    return h.intdigest()


class RedisBlockStore:
    """Blocks of ``block_bytes`` in a Redis/Valkey server at ``url``, under ``namespace``.

    ``timeout_s`` bounds connecting and every socket read/write; ``ttl_s``
    expires blocks (refreshed on every hit); ``retry_interval_s`` is how long
    an outage is assumed to last before the first probe (doubling per failed
    probe, up to ``max_retry_interval_s``). Batch calls are
    pipelined in chunks of at most ``max_batch_bytes``. Construction checks
    the URL (``ValueError``); with ``check_connection`` it also pings the
    server, raising ``RedisStoreError`` on rejected credentials and warning
    (the tier starts in an outage) when it is unreachable.

    Thread-safe: the client's connection pool hands each call its own socket.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        block_bytes: int,
        ttl_s: float | None = None,
        timeout_s: float = 0.5,
        *,
        geometry_fingerprint: str = "",
        hash_fn: str = "",
        retry_interval_s: float = 1.0,
        max_retry_interval_s: float = 30.0,
        max_batch_bytes: int = 32 << 20,
        check_connection: bool = True,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s}")
        self.url = normalize_url(url)
        self.shown_url = redact_url(url)
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max(max_retry_interval_s, retry_interval_s)
        self._interval = retry_interval_s
        self.prefix = namespace_prefix(namespace, block_bytes, geometry_fingerprint, hash_fn)
        self.value_bytes = HEADER_BYTES + block_bytes
        self._chunk = max(1, max_batch_bytes // self.value_bytes)
        self.stats = RedisStoreStats()
        self._state_lock = threading.Lock()
        self._down_until = 0.0
        self._down_since: float | None = None
        try:
            self._client = redis.Redis.from_url(
                self.url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1),
                retry_on_timeout=False,
                health_check_interval=0,
            )
        except (ValueError, redis.RedisError) as e:
            raise ValueError(f"bad Redis URL {self.shown_url!r}: {e}") from None
        if check_connection:
            self._check_connection()

    # -- health -------------------------------------------------------------

    def _check_connection(self) -> None:
        try:
            self._client.ping()
        except redis.AuthenticationError as e:
            raise RedisStoreError(f"Redis at {self.shown_url} rejected the credentials: {e}") from e
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise RedisStoreError(f"Redis at {self.shown_url} needs credentials: {e}") from e
            raise
        except _OUTAGE_ERRORS as e:
            self._mark_down(e)
        else:
            self._mark_up()

    @property
    def available(self) -> bool:
        """False while an outage is assumed (calls answer without the network)."""
        return self._down_since is None

    def _mark_down(self, err: BaseException) -> None:
        with self._state_lock:
            if self._down_since is None:
                self._interval = self.retry_interval_s
            else:
                self._interval = min(2 * self._interval, self.max_retry_interval_s)
            self._down_until = time.monotonic() + self._interval
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.stats.outages += 1
                logger.warning(
                    "Redis tier at %s is unreachable (%s: %s); its loads are misses and its "
                    "stores fail until it is back (next try in %.1fs, backing off to %.1fs)",
                    self.shown_url,
                    type(err).__name__,
                    err,
                    self.retry_interval_s,
                    self.max_retry_interval_s,
                )

    def _mark_up(self) -> None:
        if self._down_since is None:
            return
        with self._state_lock:
            if self._down_since is None:
                return
            down_for = time.monotonic() - self._down_since
            self._down_since = None
            logger.warning(
                "Redis tier at %s is back after %.1fs (%d calls skipped meanwhile)",
                self.shown_url,
                down_for,
                self.stats.calls_skipped,
            )

    def _guarded(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``, or ``fallback`` during an outage or when the server is unreachable."""
        if self._down_since is not None and time.monotonic() < self._down_until:
            self.stats.calls_skipped += 1
            return fallback
        try:
            out = fn()
        except _OUTAGE_ERRORS as e:
            self._mark_down(e)
            return fallback
        self._mark_up()
        return out

    def ping(self) -> bool:
        """Probe the server now (ignores the breaker's wait); True when it answers."""
        with self._state_lock:
            self._down_until = 0.0
        return bool(self._guarded(self._client.ping, False))

    # -- keys ---------------------------------------------------------------

    def redis_key(self, key: bytes) -> bytes:
        return self.prefix + bytes(key)

    def _chunks(self, n: int) -> list[range]:
        return [range(i, min(n, i + self._chunk)) for i in range(0, n, self._chunk)]

    # -- batch calls --------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: BlockBuffers) -> list[bool]:
        """Store ``blocks[i]`` as ``keys[i]``; per block, whether the server accepted it."""
        keys = [bytes(k) for k in keys]
        n = len(keys)
        views = as_block_views(blocks, n, self.block_bytes)
        ok = [False] * n
        for chunk in self._chunks(n):
            values = []
            for i in chunk:
                val = bytearray(self.value_bytes)
                val[HEADER_BYTES:] = views[i].data
                csum = _checksum(keys[i], views[i])
                _HEADER.pack_into(val, 0, _MAGIC, FORMAT_VERSION, self.block_bytes, csum)
                values.append(val)

            def send(chunk: range = chunk, values: list[bytearray] = values) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for i, val in zip(chunk, values):
                    pipe.set(self.redis_key(keys[i]), val, px=self.ttl_ms)
                return pipe.execute(raise_on_error=False)

            replies = self._guarded(send, None)
            if replies is None:
                continue
            errors = [r for r in replies if isinstance(r, Exception)]
            for i, r in zip(chunk, replies):
                ok[i] = r is True
            if errors:
                logger.debug("Redis tier refused %d stores: %s", len(errors), errors[0])
        stored = sum(ok)
        self.stats.blocks_written += stored
        self.stats.store_failures += n - stored
        return ok

    def _fetch(self, rkeys: list[bytes]) -> list[Any]:
        if self.ttl_ms is None:
            return self._client.mget(rkeys)
        pipe = self._client.pipeline(transaction=False)
        for k in rkeys:
            pipe.getex(k, px=self.ttl_ms)
        return pipe.execute(raise_on_error=False)

    def get_into(self, keys: Sequence[bytes], out: BlockBuffers) -> list[bool]:
        """Read ``keys[i]`` into ``out[i]``; per block, whether it is a verified hit.

        ``out[i]`` is left untouched on a miss.
        """
        keys = [bytes(k) for k in keys]
        n = len(keys)
        views = as_block_views(out, n, self.block_bytes, writable=True)
        hit = [False] * n
        corrupt: list[bytes] = []
        for chunk in self._chunks(n):
            rkeys = [self.redis_key(keys[i]) for i in chunk]
            values = self._guarded(lambda rkeys=rkeys: self._fetch(rkeys), None)
            if values is None:
                continue
            for i, rk, val in zip(chunk, rkeys, values):
                if val is None or isinstance(val, Exception):
                    continue
                payload = self._verify(keys[i], val)
                if payload is None:
                    corrupt.append(rk)
                    continue
                views[i][:] = payload
                hit[i] = True
        if corrupt:
            self.stats.corrupt_values += len(corrupt)
            logger.warning("Redis tier: dropped %d values that failed verification", len(corrupt))
            self._guarded(lambda: self._client.delete(*corrupt), 0)
        found = sum(hit)
        self.stats.blocks_read += found
        self.stats.misses += n - found
        return hit

    def _verify(self, key: bytes, val: bytes) -> np.ndarray | None:
        if len(val) != self.value_bytes:
            return None
        magic, version, length, csum = _HEADER.unpack_from(val, 0)
        if magic != _MAGIC or version != FORMAT_VERSION or length != self.block_bytes:
            return None
        payload = np.frombuffer(val, dtype=np.uint8, offset=HEADER_BYTES)
        if _checksum(key, payload) != csum:
            return None
        return payload

    def get(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Like ``get_into`` into fresh arrays; None for a miss."""
        out = np.empty((len(keys), self.block_bytes), dtype=np.uint8)
        hit = self.get_into(keys, out)
        return [out[i] if h else None for i, h in enumerate(hit)]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is on the server now (all False during an outage)."""
        keys = list(keys)
        if not keys:
            return []

        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k))
            return [r == 1 for r in pipe.execute(raise_on_error=False)]

        return self._guarded(exists, [False] * len(keys))

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (from every engine sharing the namespace); returns how many existed."""
        rkeys = [self.redis_key(k) for k in keys]
        if not rkeys:
            return 0
        return int(self._guarded(lambda: self._client.delete(*rkeys), 0))

    def clear(self) -> int:
        """Delete every block under this store's prefix (SCAN, not KEYS); returns the count."""

        def scan_delete() -> int:
            n = 0
            batch: list[bytes] = []
            for k in self._client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    n += self._client.delete(*batch)
                    batch = []
            if batch:
                n += self._client.delete(*batch)
            return n

        return self._guarded(scan_delete, 0)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RedisBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RedisBlockStore({self.shown_url!r}, namespace={self.namespace!r}, "
            f"block_bytes={self.block_bytes}, available={self.available})"
        )
