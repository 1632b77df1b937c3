"""The Mooncake tier's bytes: KV blocks as objects in a Mooncake Store, zero-copy where possible.

Key: ``kvo/<namespace>/<digest>/<hex of the block's key>``, where the digest
covers the tier fingerprint (``identity.tier_fingerprint``: model, KV
geometry, dtype, quantisation, layout, hash function and seed, parallel rank
and size), the block size and this format's version: engines whose blocks
differ never see each other's objects; engines that match share them.

Value: a 16-byte header (magic, format version, payload length, xxh3-64 of
key + payload) then the payload, put and got as two buffers of one object
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``): the
header from (into) a small registered array, the payload straight from
(into) the caller's registered memory, the CPU tier's slots. Nothing is
staged. A value of the wrong length, magic or checksum is a miss: it is
removed (forced: a reader's lease must not keep it) and the key's next store
is an upsert, since Mooncake's put is put-if-absent and would keep it.

What Mooncake does on its own, and what this store makes of it:
- a full pool evicts (approximate LRU at a high watermark): a put answered 0
  may be gone at the next get, which is then a clean miss (-704);
- a restarted master has lost every object's metadata: misses, then stores
  land again (its holders re-register by themselves);
- a dead master answers -900 (after ~4.3 s per call) and a dead segment
  holder -800: the first such code trips the breaker (``probe``), and every
  call answers at once until the master answers a probe again; the keys
  whose read failed -800 are removed and held absent for a while
  (``presence.LostKeys``), since the master still lists them;
- every exists and get takes a lease (10 s by default) during which a plain
  remove fails: this store's removes are forced.

Callers with memory that is not registered (tests, the bench's byte path,
disk -> Mooncake moves) use ``put`` / ``get_into``, which go through one
registered scratch area (a copy; serialised by a lock).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from kvoffload.tiers.mooncake.client import (
    NO_SPACE,
    OBJECT_NOT_FOUND,
    SCHEME,
    MooncakeClient,
    codes,
    is_down_code,
    open_client,
    parse_master_url,
)
from kvoffload.tiers.mooncake.presence import LOST_HOLD_S, LostKeys
from kvoffload.tiers.mooncake.probe import PROBE_INTERVAL_S, Breaker
from kvoffload.tiers.mooncake.stats import MooncakeStoreStats, refusal_alarm
from kvoffload.tiers.mooncake.values import (
    HEADER_BYTES,
    checksum,
    namespace_prefix,
    pack_header,
    verify,
)
from kvoffload.transfer.block_buffers import BlockBuffers, as_block_views

logger = logging.getLogger(__name__)

#: A key no engine stores, asked by the breaker's probe.
_PROBE_KEY = "kvo/probe"


class MooncakeBlockStore:
    """Blocks of ``block_bytes`` in the Mooncake Store whose master ``url`` names.

    ``url`` is ``mooncakestore://HOST:PORT``; ``metadata`` the transfer
    engine's metadata service (``P2PHANDSHAKE``, ``http://``, ``etcd://``);
    ``segment_bytes`` the memory this process contributes to the pool (0: a
    pure client of other holders); ``client``: an already set-up client that
    the caller owns and closes (several stores may share one), else one is
    opened here (``MooncakeUnavailable`` when it cannot) and closed by ``close``.
    Thread-safe: the client is, and the scratch area has its own lock.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        block_bytes: int,
        *,
        geometry_fingerprint: str = "",
        hash_fn: str = "",
        metadata: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        segment_bytes: int = 0,
        local_buffer_bytes: int = 16 << 20,
        client: MooncakeClient | None = None,
        probe_interval_s: float = PROBE_INTERVAL_S,
        lost_hold_s: float = LOST_HOLD_S,
        scratch_blocks: int = 16,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.master = parse_master_url(url)
        self.protocol = protocol
        self.shown_url = f"{SCHEME}://{self.master.addr}"
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.value_bytes = HEADER_BYTES + block_bytes
        self.prefix = namespace_prefix(namespace, block_bytes, geometry_fingerprint, hash_fn)
        # Every engine that names the same prefix can load what another stored.
        self.ownership = "mooncake:" + self.prefix[len("kvo/") : -1].replace("/", ":")
        self._stats = MooncakeStoreStats()
        self._stats_lock = threading.Lock()
        self._refusals = refusal_alarm(self.shown_url)
        self.lost = LostKeys(lost_hold_s)
        self._rewrite: set[str] = set()  # keys whose stored value was bad: upsert next time
        self._registered: list[int] = []
        self._owns_client = client is None
        self._closed = False
        if client is None:
            client = open_client(
                self.master,
                metadata=metadata,
                protocol=protocol,
                segment_bytes=segment_bytes,
                local_buffer_bytes=local_buffer_bytes,
            )
        self._client = client
        self.breaker = Breaker(
            self.master, self._probe, interval_s=probe_interval_s, shown=self.shown_url
        )
        self._scratch_lock = threading.Lock()
        self._scratch = np.zeros((max(1, scratch_blocks), self.value_bytes), dtype=np.uint8)
        self.register(self._scratch.ctypes.data, self._scratch.nbytes)

    # -- health -------------------------------------------------------------

    def _probe(self) -> bool:
        return codes(self._client.batch_is_exist([_PROBE_KEY]), 1)[0] >= 0

    @property
    def available(self) -> bool:
        """False while the breaker is tripped (calls answer at once, touching nothing)."""
        return self.breaker.available

    @property
    def stats(self) -> MooncakeStoreStats:
        self._stats.outages = self.breaker.outages
        self._stats.calls_skipped = self.breaker.calls_skipped
        return self._stats

    def ping(self) -> bool:
        """Ask the master now (ignores the breaker); True when it answers."""
        try:
            return self._probe()
        except Exception:
            return False

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _observe(self, answers: Sequence[int], call: str) -> None:
        down = [c for c in answers if is_down_code(c)]
        if down:
            self.breaker.trip(f"{call} answered {down[0]}")

    # -- memory -------------------------------------------------------------

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr`` for zero-copy puts and gets (once per region)."""
        rc = self._client.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake refused to register {nbytes} bytes (code {rc})")
        self._registered.append(ptr)

    @contextlib.contextmanager
    def registered(self, *arrays: np.ndarray) -> Iterator[None]:
        """``arrays`` registered for the duration (a staging area of one call).

        Cheap over TCP (~5 us a region); over RDMA registration pins and maps
        memory (milliseconds): there, register long-lived memory once instead.
        """
        done: list[int] = []
        try:
            for arr in arrays:
                if arr.nbytes:
                    self.register(arr.ctypes.data, arr.nbytes)
                    done.append(arr.ctypes.data)
            yield
        finally:
            for ptr in done:
                self._registered.remove(ptr)
                self._unregister(ptr)

    def object_key(self, key: bytes) -> str:
        return self.prefix + bytes(key).hex()

    # -- zero-copy batch calls ------------------------------------------------

    def put_views(
        self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], headers: Sequence[np.ndarray]
    ) -> list[bool]:
        """Store ``payloads[i]`` as ``keys[i]``, its header written into ``headers[i]``.

        Both live in registered memory (``register``); per block, whether the
        store accepted it (accepted is not kept: a full pool evicts).
        """
        n = len(keys)
        if n == 0:
            return []
        if self.breaker.skip():
            self._count(store_failures=n)
            return [False] * n
        okeys = [self.object_key(k) for k in keys]
        for i in range(n):
            csum = checksum(okeys[i], payloads[i])
            pack_header(headers[i], self.block_bytes, csum)
        answers = [0] * n
        plain = [i for i in range(n) if okeys[i] not in self._rewrite]
        if plain:
            got = self._client.batch_put_from_multi_buffers(
                [okeys[i] for i in plain],
                [[headers[i].ctypes.data, payloads[i].ctypes.data] for i in plain],
                [[HEADER_BYTES, self.block_bytes]] * len(plain),
            )
            for i, c in zip(plain, codes(got, len(plain))):
                answers[i] = c
        if len(plain) < n:
            self._upsert([i for i in range(n) if i not in set(plain)], okeys, payloads, answers)
        self._observe(answers, "put")
        return self._settle_puts(okeys, answers)

    def _upsert(
        self, idx: list[int], okeys: list[str], payloads: Sequence[np.ndarray], answers: list[int]
    ) -> None:
        """Replace the values of keys found bad (one value buffer per key: a staged copy)."""
        values = np.empty((len(idx), self.value_bytes), dtype=np.uint8)
        for j, i in enumerate(idx):
            csum = checksum(okeys[i], payloads[i])
            pack_header(values[j], self.block_bytes, csum)
            values[j, HEADER_BYTES:] = payloads[i]
        if self._client.register_buffer(values.ctypes.data, values.nbytes) != 0:
            for i in idx:
                answers[i] = -1  # not stored: counted as failed
            return
        try:
            got = self._client.batch_upsert_from(
                [okeys[i] for i in idx],
                [values[j].ctypes.data for j in range(len(idx))],
                [self.value_bytes] * len(idx),
            )
        finally:
            self._unregister(values.ctypes.data)
        for i, c in zip(idx, codes(got, len(idx))):
            answers[i] = c
        self._count(upserts=len(idx))

    def _settle_puts(self, okeys: list[str], answers: list[int]) -> list[bool]:
        ok = [c == 0 for c in answers]
        stored = [k for k, good in zip(okeys, ok) if good]
        self._rewrite.difference_update(stored)
        self.lost.clear(stored)
        refused = sum(1 for c in answers if c == NO_SPACE)
        self._count(
            blocks_written=len(stored),
            store_failures=len(ok) - len(stored),
            refused_stores=refused,
        )
        if refused:
            self._refusals.failed(RuntimeError(f"code {NO_SPACE}: no room"), count=refused)
        elif stored:
            self._refusals.succeeded()
        return ok

    def get_views(
        self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], headers: Sequence[np.ndarray]
    ) -> list[bool]:
        """Read ``keys[i]`` into ``headers[i]`` + ``payloads[i]`` (registered memory).

        Per block, whether it is a verified hit; on a miss the buffers hold
        garbage (not to be used).
        """
        n = len(keys)
        if n == 0:
            return []
        if self.breaker.skip():
            self._count(misses=n)
            return [False] * n
        okeys = [self.object_key(k) for k in keys]
        got = self._client.batch_get_into_multi_buffers(
            okeys,
            [[headers[i].ctypes.data, payloads[i].ctypes.data] for i in range(n)],
            [[HEADER_BYTES, self.block_bytes]] * n,
        )
        answers = self._short_values(okeys, codes(got, n))
        hit = [False] * n
        bad: list[str] = []
        lost: list[str] = []
        for i, c in enumerate(answers):
            if c == self.value_bytes and self._verify(okeys[i], headers[i], payloads[i]):
                hit[i] = True
            elif is_down_code(c):
                if c > -900:  # the holder, not the master: these bytes are gone
                    lost.append(okeys[i])
            elif c != OBJECT_NOT_FOUND:
                bad.append(okeys[i])
        master_down = any(is_down_code(c) and c <= -900 for c in answers)
        self._drop(bad, lost, remove=not master_down)
        self._observe(answers, "get")
        found = sum(hit)
        self._count(blocks_read=found, misses=n - found)
        return hit

    def _short_values(self, okeys: list[str], answers: list[int]) -> list[int]:
        """-800 also answers a value shorter than ours: those become their (wrong) size.

        Only a transfer failure of a value of our size means a lost holder.
        """
        for i, c in enumerate(answers):
            if is_down_code(c) and c > -900:
                size = int(self._client.get_size(okeys[i]))
                if size >= 0 and size != self.value_bytes:
                    answers[i] = size
        return answers

    def _verify(self, okey: str, header: np.ndarray, payload: np.ndarray) -> bool:
        return verify(okey, header, payload, self.block_bytes)

    def _drop(self, bad: list[str], lost: list[str], remove: bool) -> None:
        """Remove values that failed verification (rewritten by upsert) and lost ones
        (``remove``: the master answers; before the breaker trips on a lost holder)."""
        if bad:
            self._count(corrupt_values=len(bad))
            self._rewrite.update(bad)
            logger.warning("Mooncake tier: dropped %d values that failed verification", len(bad))
        if lost:
            self._count(lost_blocks=len(lost))
            self.lost.add(lost)
        if (bad or lost) and remove and self.breaker.available:
            self._client.batch_remove(bad + lost, force=True)

    # -- byte calls (through the scratch area) --------------------------------

    def put(self, keys: Sequence[bytes], blocks: BlockBuffers, *where: Sequence[int]) -> list[bool]:
        """Store ``blocks[i]`` as ``keys[i]`` from any CPU memory (one copy each).

        ``where`` is ignored (``SlotStore``'s placement: the master places blocks).
        """
        n = len(keys)
        views = as_block_views(blocks, n, self.block_bytes)
        ok: list[bool] = []
        step = len(self._scratch)
        with self._scratch_lock:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                rows = self._scratch[: hi - lo]
                for j in range(hi - lo):
                    rows[j, HEADER_BYTES:] = views[lo + j]
                ok += self.put_views(
                    keys[lo:hi], [r[HEADER_BYTES:] for r in rows], [r[:HEADER_BYTES] for r in rows]
                )
        return ok

    def get_into(
        self, keys: Sequence[bytes], out: BlockBuffers, *where: Sequence[int]
    ) -> list[bool]:
        """Read ``keys[i]`` into ``out[i]`` (any CPU memory); ``out[i]`` untouched on a miss."""
        n = len(keys)
        views = as_block_views(out, n, self.block_bytes, writable=True)
        hit: list[bool] = []
        step = len(self._scratch)
        with self._scratch_lock:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                rows = self._scratch[: hi - lo]
                got = self.get_views(
                    keys[lo:hi], [r[HEADER_BYTES:] for r in rows], [r[:HEADER_BYTES] for r in rows]
                )
                for j, h in enumerate(got):
                    if h:
                        views[lo + j][:] = rows[j, HEADER_BYTES:]
                hit += got
        return hit

    def get(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Like ``get_into`` into fresh arrays; None for a miss."""
        out = np.empty((len(keys), self.block_bytes), dtype=np.uint8)
        hit = self.get_into(keys, out)
        return [out[i] if h else None for i, h in enumerate(hit)]

    # -- presence and removal ---------------------------------------------------

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the master lists each key now (all False while the breaker is tripped).

        Keys whose bytes were found unreachable are absent for a while
        (``presence.LostKeys``), whatever the master still says.
        """
        n = len(keys)
        if n == 0:
            return []
        if self.breaker.skip():
            return [False] * n
        okeys = [self.object_key(k) for k in keys]
        answers = codes(self._client.batch_is_exist(okeys), n)
        self._observe(answers, "exists")
        lost = self.lost.mask(okeys)
        return [c == 1 and not gone for c, gone in zip(answers, lost)]

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` (forced: leases do not stop it); returns how many were removed."""
        if not keys or self.breaker.skip():
            return 0
        answers = codes(
            self._client.batch_remove([self.object_key(k) for k in keys], True), len(keys)
        )
        self._observe(answers, "remove")
        return sum(1 for c in answers if c == 0)

    def clear(self) -> int:
        """Remove every object under this store's prefix (an operator's decision)."""
        if self.breaker.skip():
            return 0
        n = self._client.remove_by_regex("^" + re.escape(self.prefix), True)
        return max(0, int(n))

    def _unregister(self, ptr: int) -> None:
        self._client.unregister_buffer(ptr)

    def close(self) -> None:
        """Stop the probe, unregister this store's memory, close an owned client (once).

        Every call that used the caller's memory has returned and the memory is
        unregistered when this returns. The owned client's own close waits ~1-2 s
        for its threads to wind down: it runs on a (non-daemon) thread of its own,
        which the interpreter waits for at exit, so closing an engine does not.
        """
        if self._closed:
            return
        self._closed = True
        self.breaker.close()
        self._refusals.report_at_close()
        for ptr in self._registered:
            self._unregister(ptr)
        self._registered.clear()
        if self._owns_client:
            closer = threading.Thread(
                target=self._client.close, name="kvoffload-mooncake-close", daemon=False
            )
            try:
                closer.start()
            except RuntimeError:  # the interpreter is shutting down: no new threads
                self._client.close()

    def __enter__(self) -> MooncakeBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"MooncakeBlockStore({self.shown_url!r}, namespace={self.namespace!r}, "
            f"block_bytes={self.block_bytes}, available={self.available})"
        )
