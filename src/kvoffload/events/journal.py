"""Event payloads of a persistent tier's blocks, kept across engine restarts.

A disk tier outlives its engine, but its files hold KV bytes, not the tokens
a router needs to index a block. ``PayloadJournal`` keeps, next to the tier,
the self-describing payload of every block the tier announced (hashes,
parent, tokens, block size, LoRA, extra keys), so a restarted engine
announces what the disk still holds with its tokens at once
(``kvoffload.engine.connector.events``).

File: records appended as they happen, each ``[length (4 bytes, big
endian)][msgpack [key, payload or None]]``; None deletes the key. A torn
tail (a crash mid-write) ends the replay at the last whole record. On open
the file is read once and rewritten compacted (atomic rename). Writes are
buffered and flushed once per call of ``flush`` (once per engine step):
losing the last records in a crash costs only placeholders (a block
announced without tokens), never a wrong payload, because a payload is
written under the block's own key and keys are content hashes.

Invariant: memory and file size are bounded by the tier's holdings (plus
deletions not yet compacted away), not by the engine's history.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

JOURNAL_NAME = "event-payloads.log"
_LEN = struct.Struct(">I")
#: A record longer than this is corruption, not a payload.
_MAX_RECORD = 1 << 24

Payload = tuple[Any, ...]


class PayloadJournal:
    """``key -> payload`` persisted in ``path`` (module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()
        self.entries: dict[bytes, Payload] = self._read()
        self._pending: list[bytes] = []
        self._rewrite()
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for appends

    def _read(self) -> dict[bytes, Payload]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            logger.warning("KV event journal %s unreadable (%s); starting empty", self.path, exc)
            return {}
        out: dict[bytes, Payload] = {}
        pos = 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            end = pos + _LEN.size + n
            if n > _MAX_RECORD or end > len(data):
                break  # a torn tail
            try:
                key, payload = self._decoder.decode(data[pos + _LEN.size : end])
            except (msgspec.DecodeError, TypeError, ValueError):
                break
            if payload is None:
                out.pop(bytes(key), None)
            else:
                out[bytes(key)] = tuple(payload)
            pos = end
        return out

    def _record(self, key: bytes, payload: Payload | None) -> bytes:
        body = self._encoder.encode([key, payload])
        return _LEN.pack(len(body)) + body

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(self._record(k, p) for k, p in self.entries.items()))
        os.replace(tmp, self.path)

    def get(self, key: bytes) -> Payload | None:
        return self.entries.get(key)

    def put(self, key: bytes, payload: Payload) -> None:
        self.entries[key] = payload
        self._pending.append(self._record(key, payload))

    def delete(self, key: bytes) -> None:
        if self.entries.pop(key, None) is not None:
            self._pending.append(self._record(key, None))

    def keep_only(self, keys: set[bytes]) -> None:
        """Forget every entry but ``keys`` (what the tier holds), compacting the file."""
        if set(self.entries) <= keys:
            return
        self.flush()
        self.entries = {k: p for k, p in self.entries.items() if k in keys}
        self._file.close()
        self._rewrite()
        self._file = open(self.path, "ab")  # noqa: SIM115

    def flush(self) -> None:
        if not self._pending:
            return
        data, self._pending = b"".join(self._pending), []
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:  # a full disk costs tokens after a restart, nothing else
            logger.warning("KV event journal %s: write failed (%s)", self.path, exc)

    def close(self) -> None:
        self.flush()
        self._file.close()
