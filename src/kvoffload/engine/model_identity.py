"""Model identity: a short string that differs whenever two models' KV could differ.

A persistent or shared tier (a disk directory, a Redis namespace) must never
hand one model's KV blocks to another. Block hashes cover tokens only, so
two models of the same shape produce the same hashes; the tier's fingerprint
therefore includes the model's identity (see ``kvoffload.tiers.identity
.tier_fingerprint``). The identity is one of:

- ``ckpt:<digest>`` for a local checkpoint: xxh3-128 over ``config.json``
  and every safetensors file (names, sizes and bytes, in the loader's
  order). Hashing a large checkpoint takes a while, so digests are cached on
  disk keyed by each file's resolved path, size and mtime (ns): a restart
  re-reads nothing unless a file changed. The cache lives in
  ``$KVOFFLOAD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvoffload`` or
  ``~/.cache/kvoffload``); when it cannot be written the digest is still
  right, only not remembered.
- ``random:seed=<seed>:<digest>`` for the embedded random model: its weights
  are a function of its ``ModelConfig`` and seed, so those are its identity.
- ``name:<name>@<revision>`` where a model name and revision are all the
  engine has (an integration that does not see the weights, e.g. the vLLM
  plug-in). Two different checkpoints under one name and revision cannot be
  told apart this way: pass a revision that pins the weights.

Identities contain no ``;`` or ``=`` outside the fixed forms above (names are
percent-encoded), so they sit safely inside a fingerprint string.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import xxhash

_CACHE_FILE = "model-digests.json"
_CACHE_VERSION = 1
_CHUNK = 8 << 20
_cache_lock = threading.Lock()


def cache_dir() -> Path:
    """Where checkpoint digests are remembered across processes."""
    explicit = os.environ.get("KVOFFLOAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvoffload"


def _file_stamp(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _read_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "entries": entries}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def _hash_files(files: list[Path]) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()


def checkpoint_identity(path: str | os.PathLike[str], *, use_cache: bool = True) -> str:
    """``ckpt:<xxh3-128>`` of the checkpoint at ``path`` (config.json + weight files).

    Raises what ``checkpoint.weight_files`` raises for a missing directory or
    weights (``FileNotFoundError``/``ValueError``).
    """
    from kvoffload.engine.checkpoint import CONFIG_FILE, weight_files

    root = Path(path).expanduser()
    files = [root / CONFIG_FILE, *weight_files(root)]
    stamp = json.dumps([_file_stamp(f) for f in files])
    key = xxhash.xxh3_128_hexdigest(stamp.encode())
    cache = cache_dir() / _CACHE_FILE
    if use_cache:
        with _cache_lock:
            hit = _read_cache(cache).get(key)
        if isinstance(hit, str) and hit:
            return hit
    ident = f"ckpt:{_hash_files(files)}"
    if use_cache:
        with _cache_lock:
            entries = _read_cache(cache)
            entries[key] = ident
            if len(entries) > 256:  # keep the newest few: dicts keep insertion order
                entries = dict(list(entries.items())[-256:])
            _write_cache(cache, entries)
    return ident


def random_model_identity(model_config: Any, seed: int) -> str:
    """``random:seed=<seed>:<digest>`` of the embedded model's config (a dataclass or dict)."""
    is_instance = is_dataclass(model_config) and not isinstance(model_config, type)
    cfg = asdict(model_config) if is_instance else dict(model_config)
    blob = json.dumps(cfg, sort_keys=True, default=str)
    return f"random:seed={int(seed)}:{xxhash.xxh3_64_hexdigest(blob.encode())}"


def named_model_identity(name: str, revision: str | None = None) -> str:
    """``name:<name>@<revision>`` for an engine that knows only its model's name."""
    if not name:
        raise ValueError("a model identity needs a non-empty model name")
    safe = "/:@.-_+"
    rev = urllib.parse.quote(revision or "unknown", safe=safe)
    return f"name:{urllib.parse.quote(name, safe=safe.replace('@', ''))}@{rev}"


def engine_model_identity(model_path: str | None, model_config: Any, seed: int) -> str:
    """The identity of the reference engine's model: its checkpoint, else the random model."""
    if model_path is None:
        return random_model_identity(model_config, seed)
    return checkpoint_identity(model_path)
