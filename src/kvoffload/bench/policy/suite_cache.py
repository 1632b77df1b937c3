"""A file cache of vLLM's rows for ``kvoffload bench offload --suite``.

vLLM's three managers are most of a suite run's time and never change with
kvoffload's code: their hit rates depend only on the trace, the capacity, the
row (policy, store_threshold), the replay's key positions and vLLM's version.
So they are kept in one JSON file (``default_path()``) under a key of exactly
those, and a second run replays only kvoffload's policies.

Invariants: a cached entry is used only when every part of its key matches
(a new vLLM version or replay change misses, never reuses); a file that cannot
be read or parsed is treated as empty (a clean miss) and rewritten whole on
``save``; writes go to a temporary file renamed over the old one, so a run
stopped mid-write leaves the previous cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.offload import OffloadKey

Trace = Sequence[Sequence[OffloadKey]]
CACHE_ENV = "KVOFFLOAD_SUITE_CACHE"


def default_path() -> Path:
    """``$KVOFFLOAD_SUITE_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/kvoffload."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvoffload" / "suite_vllm_rows.json"


def trace_digest(trace: Trace) -> str:
    """A digest of the trace's keys, request by request (equal traces, equal digests)."""
    h = hashlib.sha256()
    for keys in trace:
        h.update(len(keys).to_bytes(4, "big"))
        for k in keys:
            h.update(k)
    return h.hexdigest()


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "unknown"


class VllmRowCache:
    """``rows(trace, capacity)`` from the file when it has them, else from ``compute``."""

    def __init__(self, path: Path, compute: Callable[[Trace, int], dict[str, float]]) -> None:
        self.path = path
        self.compute = compute
        self.hits = self.misses = 0
        try:
            data = json.loads(path.read_text())
            self._entries: dict[str, dict[str, float]] = dict(data["entries"])
        except (OSError, ValueError, KeyError, TypeError):
            self._entries = {}
        # What else decides vLLM's figures: its version, the rows, the replay's positions.
        self._salt = json.dumps(
            [_vllm_version(), sorted(offload_vllm.ROWS.items()), offload_vllm.TOKENS_PER_BLOCK]
        )
        self._digests: dict[int, str] = {}

    def _key(self, trace: Trace, capacity: int) -> str:
        digest = self._digests.get(id(trace))
        if digest is None:
            digest = self._digests[id(trace)] = trace_digest(trace)
        return hashlib.sha256(f"{self._salt}|{digest}|{capacity}".encode()).hexdigest()

    def rows(self, trace: Trace, capacity: int) -> dict[str, float]:
        key = self._key(trace, capacity)
        got = self._entries.get(key)
        if got is not None and set(got) == set(offload_vllm.ROWS):
            self.hits += 1
            return dict(got)
        self.misses += 1
        got = self.compute(trace, capacity)
        self._entries[key] = dict(got)
        return got

    def save(self) -> None:
        """Write the file (creating its folder); an OSError propagates to the caller."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"entries": self._entries}))
        tmp.replace(self.path)
