"""One description of the tiers below CPU memory, checked once, built by every front end.

The CLI flags, ``EngineConfig`` and vLLM's ``kv_connector_extra_config`` all
end in one ``TierConfig``: the disk tier (``disk_dir`` and its budget), the
Redis / Valkey tier (``redis_url`` and its knobs) and how the tiers are fed
(``write_mode``, worker threads, events). ``TierIdentity`` carries what the
engine knows about the KV bytes (model, hash function, quantisation, rank);
together with the KV layout it becomes the tiers' fingerprint
(``kvoffload.tiers.identity``).

Invariants: a ``TierConfig`` that exists is valid (``__post_init__`` checks
every field; errors are one-line ``TierConfigError``s naming the key, prefixed
with where the value came from), and names at least one lower tier.
``redis_url`` is stored normalised (``valkey://`` mapped to ``redis://``,
cluster seed lists checked), sizes as integers of bytes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WRITE_MODES = ("write_back", "write_through")
MOONCAKE_KEYS = (
    "mooncake_url",
    "mooncake_namespace",
    "mooncake_metadata",
    "mooncake_protocol",
    "mooncake_segment_bytes",
    "mooncake_local_buffer_bytes",
)

#: Keys ``TierConfig.from_mapping`` reads (the dataclass's fields, plus ``write_through``).
TIER_KEYS: tuple[str, ...] = (
    "disk_dir",
    "disk_bytes",
    "disk_blocks",
    "redis_url",
    "redis_namespace",
    "redis_ttl_s",
    "redis_timeout_s",
    "write_mode",
    "write_through",
    "num_threads",
    "direct_io",
    "enable_events",
    "redis_async_presence",
    *MOONCAKE_KEYS,
)
#: The keys that name a lower tier (at least one must be set).
TIER_NAMING_KEYS = ("disk_dir", "redis_url", "mooncake_url")


class TierConfigError(ValueError):
    """A bad lower-tier setting; the message is one line naming the key."""


def _fail(where: str, key: str, why: str) -> TierConfigError:
    return TierConfigError(f"{where}[{key!r}]: {why}" if where else f"{key}: {why}")


def _parse_size(where: str, key: str, value: Any) -> int:
    from kvoffload.transfer.sizing import parse_bytes

    try:
        n = parse_bytes(value)
    except (ValueError, TypeError) as exc:
        raise _fail(where, key, str(exc)) from None
    if n <= 0:
        raise _fail(where, key, f"must be positive, got {value!r}")
    return n


def parse_bool(value: Any) -> bool:
    """A boolean setting as config files and CLIs write it: a bool, "true"/"false"/"1"/"0"
    (any case, spaces around), or the integers 0 and 1; anything else is a ``ValueError``
    whose message is "expected true or false, got <value>" (callers prefix the key).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"expected true or false, got {value!r}")


def _parse_bool(where: str, key: str, value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError as exc:
        raise _fail(where, key, str(exc)) from None


def parse_redis_url(value: Any, *, where: str = "", key: str = "redis_url") -> str:
    """``value`` as the Redis tier takes it (normalised), or a ``TierConfigError`` naming ``key``.

    Accepts what ``--redis-url`` accepts: ``redis://``, ``rediss://``,
    ``valkey://``, ``unix://`` and ``redis+cluster://seed,seed`` URLs.
    """
    return _parse_url(where, key, value)


def _parse_url(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, key, f"expected a Redis URL such as redis://host:6379/0, got {value!r}")
    # Imported here: redis-py is only needed once a Redis tier is configured.
    from kvoffload.tiers.redis.store import normalize_url

    try:
        return normalize_url(value.strip())
    except ValueError as exc:
        raise _fail(where, key, str(exc)) from None


def _positive_number(where: str, key: str, value: Any, *, integer: bool) -> Any:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok_type or isinstance(value, bool) or value <= 0:
        kind = "int" if integer else "number"
        raise _fail(where, key, f"must be a positive {kind}, got {value!r}")
    return value


@dataclass(frozen=True)
class TierIdentity:
    """What decides the KV bytes besides the layout; goes into the tiers' fingerprint.

    ``model_id`` is the model's identity (``kvoffload.engine.model_identity``,
    never empty); ``hash_fn`` / ``hash_seed`` the block-hash function and its
    chain seed (None: random per process); ``kv_quant`` the KV quantisation;
    ``tp_rank`` / ``tp_size`` the tensor-parallel position.
    """

    model_id: str
    hash_fn: str
    hash_seed: str | None = ""
    kv_quant: str = "none"
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_id:
            raise TierConfigError("the lower tiers need the model's identity (model_id)")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise TierConfigError(
                f"tensor-parallel rank {self.tp_rank} of {self.tp_size} is not valid"
            )


@dataclass(frozen=True)
class TierConfig:
    """The lower tiers: disk (``disk_dir``), Redis (``redis_url``), or both.

    - ``disk_dir``: the disk tier's directory; its budget is ``disk_bytes``
      (bytes; rounded down to whole CPU slots) or ``disk_blocks`` (CPU slots);
      ``disk_bytes`` wins when both are set. ``direct_io``: O_DIRECT on/off,
      None = where the filesystem allows it.
    - ``redis_url``: ``redis://``, ``rediss://``, ``valkey://``, ``unix://``
      or a ``redis+cluster://h1:p1,h2:p2`` seed list; ``redis_namespace``
      prefixes every key; ``redis_ttl_s`` expires blocks (None: never);
      ``redis_timeout_s`` bounds each call (a slower server is an outage);
      ``redis_async_presence``: lookups answer from known presence and ask
      the server off the scheduler thread, one pipelined round trip per
      step (False: one synchronous round trip per lookup).
    - ``mooncake_url``: a Mooncake Store master, ``mooncakestore://HOST:PORT``,
      and its ``mooncake_*`` knobs (``kvoffload.tiers.mooncake.settings``);
      the Mooncake and Redis tiers are both the shared remote tier: one or
      the other.
    - ``write_mode``: "write_back" (blocks go down when the CPU tier evicts
      them) or "write_through" (every stored block at once).
    - ``num_threads``: worker threads per lower tier; ``enable_events``:
      emit stored/removed events for the lower tiers.
    - ``where``: how error messages name the source ("--redis-url",
      "kv_connector_extra_config"); not part of the value's identity.
    """

    disk_dir: str | None = None
    disk_bytes: int | None = None
    disk_blocks: int | None = None
    redis_url: str | None = None
    redis_namespace: str = "kvoffload"
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 0.5
    write_mode: str = "write_back"
    num_threads: int = 2
    direct_io: bool | None = None
    enable_events: bool = True
    redis_async_presence: bool = True
    mooncake_url: str | None = None
    mooncake_namespace: str = "kvoffload"
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_protocol: str = "tcp"
    mooncake_segment_bytes: int = 0
    mooncake_local_buffer_bytes: int = 16 << 20
    where: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        w = self.where
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or not str(self.disk_dir).strip():
                raise _fail(w, "disk_dir", f"expected a directory path, got {self.disk_dir!r}")
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
        if self.disk_bytes is not None:
            object.__setattr__(self, "disk_bytes", _parse_size(w, "disk_bytes", self.disk_bytes))
        if self.disk_blocks is not None:
            _positive_number(w, "disk_blocks", self.disk_blocks, integer=True)
        if self.disk_dir is None and (self.disk_bytes is not None or self.disk_blocks is not None):
            key = "disk_bytes" if self.disk_bytes is not None else "disk_blocks"
            raise _fail(w, key, "needs disk_dir")
        if self.disk_dir is not None and self.disk_bytes is None and self.disk_blocks is None:
            raise _fail(w, "disk_bytes", 'missing: the disk tier\'s budget, e.g. "500GiB"')
        if self.redis_url is not None:
            object.__setattr__(self, "redis_url", _parse_url(w, "redis_url", self.redis_url))
        if not isinstance(self.redis_namespace, str) or not self.redis_namespace:
            raise _fail(
                w, "redis_namespace", f"expected a non-empty string, got {self.redis_namespace!r}"
            )
        if self.redis_ttl_s is not None:
            _positive_number(w, "redis_ttl_s", self.redis_ttl_s, integer=False)
        _positive_number(w, "redis_timeout_s", self.redis_timeout_s, integer=False)
        if self.write_mode not in WRITE_MODES:
            raise _fail(
                w, "write_mode", f"must be one of {', '.join(WRITE_MODES)}, got {self.write_mode!r}"
            )
        _positive_number(w, "num_threads", self.num_threads, integer=True)
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise _fail(w, "direct_io", f"expected true, false or unset, got {self.direct_io!r}")
        for key in ("enable_events", "redis_async_presence"):
            if not isinstance(getattr(self, key), bool):
                raise _fail(w, key, f"expected true or false, got {getattr(self, key)!r}")
        self._check_mooncake()
        if self.disk_dir is None and self.redis_url is None and self.mooncake_url is None:
            raise _fail(w, "disk_dir", "no lower tier: set disk_dir, redis_url or mooncake_url")

    def _check_mooncake(self) -> None:
        from kvoffload.tiers.mooncake import settings

        try:
            checked = settings.check({k: getattr(self, k) for k in settings.KEYS})
        except settings.MooncakeSettingError as exc:
            raise _fail(self.where, exc.key, exc.why) from None
        for key, value in checked.items():
            object.__setattr__(self, key, value)
        if self.mooncake_url is not None and self.redis_url is not None:
            why = "cannot be combined with redis_url (both are the shared remote tier)"
            raise _fail(self.where, "mooncake_url", why)

    @property
    def has_disk(self) -> bool:
        return self.disk_dir is not None

    @property
    def has_redis(self) -> bool:
        return self.redis_url is not None

    @property
    def has_mooncake(self) -> bool:
        return self.mooncake_url is not None

    @property
    def write_through(self) -> bool:
        return self.write_mode == "write_through"

    def replace(self, **changes: Any) -> TierConfig:
        """A copy with ``changes`` applied (and checked again)."""
        return dataclasses.replace(self, **changes)

    def disk_slots(self, slot_bytes: int) -> int:
        """The disk tier's capacity in CPU slots of ``slot_bytes`` (at least one, or an error)."""
        if self.disk_bytes is None:
            assert self.disk_blocks is not None  # __post_init__: a disk tier has a budget
            return self.disk_blocks
        n = self.disk_bytes // slot_bytes
        if n < 1:
            raise _fail(
                self.where,
                "disk_bytes",
                f"budget {self.disk_bytes} bytes is smaller than one block ({slot_bytes} bytes)",
            )
        return n

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, where: str = "") -> TierConfig | None:
        """The config a mapping of ``TIER_KEYS`` describes; None when it names no lower tier.

        Values may be strings (sizes such as "1TiB", booleans as "true"), as a
        JSON or command-line source gives them. ``write_through: true`` is
        the same as ``write_mode: "write_through"``. Keys outside
        ``TIER_KEYS`` are an error naming the key (a typo must not silently
        run without a tier).
        """
        unknown = [k for k in mapping if k not in TIER_KEYS]
        if unknown:
            raise _fail(where, unknown[0], f"unknown key; known: {', '.join(TIER_KEYS)}")
        m = {k: v for k, v in mapping.items() if v is not None}
        if not any(k in m for k in TIER_NAMING_KEYS):
            for key in ("disk_bytes", "disk_blocks", "write_through", "write_mode"):
                if key in m and not (
                    key == "write_through" and not _parse_bool(where, key, m[key])
                ):
                    why = "needs a lower tier (disk_dir, redis_url or mooncake_url)"
                    raise _fail(where, key, why)
            return None
        args: dict[str, Any] = {"where": where}
        for key in ("disk_dir", "redis_url", "redis_namespace", "write_mode", *MOONCAKE_KEYS):
            if key in m:
                args[key] = m[key]
        if "disk_bytes" in m:
            args["disk_bytes"] = _parse_size(where, "disk_bytes", m["disk_bytes"])
        for key, integer in (
            ("disk_blocks", True),
            ("num_threads", True),
            ("redis_ttl_s", False),
            ("redis_timeout_s", False),
        ):
            if key in m:
                args[key] = _number(where, key, m[key], integer=integer)
        for key in ("direct_io", "enable_events", "redis_async_presence"):
            if key in m:
                args[key] = _parse_bool(where, key, m[key])
        if "write_through" in m:
            through = _parse_bool(where, "write_through", m["write_through"])
            if "write_mode" in m and (m["write_mode"] == "write_through") != through:
                raise _fail(where, "write_through", "contradicts write_mode")
            args["write_mode"] = "write_through" if through else "write_back"
        return cls(**args)


def _number(where: str, key: str, value: Any, *, integer: bool) -> Any:
    """A number from a JSON value or a string ("4", "0.5")."""
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            kind = "int" if integer else "number"
            raise _fail(where, key, f"must be a positive {kind}, got {value!r}") from None
    return _positive_number(where, key, value, integer=integer)
