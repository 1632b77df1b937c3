"""KV cache event types and their two wire profiles.

The engine builds events as the structs below (:class:`BlockStored`,
:class:`BlockRemoved`, :class:`AllBlocksCleared`, in a :class:`KVEventBatch`),
with block hashes as the raw hash bytes and kvoffload's medium names ("GPU",
"CPU", "DISK", "REMOTE"). They are *not* sent as they are: a wire profile
encodes them.

``"vllm"`` (the default) is byte for byte what vLLM 0.33's
``vllm.distributed.kv_events`` sends:

* the batch is the array ``[ts, events, data_parallel_rank]`` (the rank
  always a number);
* each event is a map tagged ``"type"`` with every field vLLM declares without
  a default present (``lora_id``, ``medium``, ``lora_name`` even when None) and
  vLLM's optional fields (``extra_keys``, ``group_idx``, ``locality``, ...)
  omitted when None, as vLLM's ``omit_defaults`` does;
* block hashes are integers, ``int.from_bytes(hash, "big") & (2**64 - 1)``
  (vLLM's ``maybe_convert_block_hash``), unless the environment sets
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, as vLLM honours it too;
* ``group_idx`` is always sent on block events (0, kvoffload's one KV cache
  group, unless the event names another), as vLLM's block pool and offloading
  connector send it;
* media are vLLM's names: "GPU", "CPU" and "STORAGE"; kvoffload's disk tier
  is ``medium="STORAGE", locality="LOCAL"`` and its shared remote tier
  ``medium="STORAGE", locality="REMOTE"`` (vLLM's ``Locality``).

``"legacy"`` is kvoffload's earlier layout, kept for consumers that parse it
(llm-d's adapter): the same batch array, each event a tagged *array*
``[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]`` / ``[tag, block_hashes, medium]`` / ``[tag]``, hashes as
the raw bytes, kvoffload's medium names.

:func:`decode_batch` reads either profile (and vLLM's own publisher's
batches) back into the structs below, with the values as they were on the
wire: integer hashes and "STORAGE" media stay so; :func:`kvoffload_medium`
maps a decoded event back to kvoffload's tier name.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable
from typing import Any, Final, Literal, NamedTuple, cast

import msgspec

#: A block hash as it travels on the wire: raw bytes or an integer.
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"
#: vLLM 0.33's name for every non-CPU offloading tier.
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

WireProfile = Literal["vllm", "legacy"]
PROFILE_VLLM: Final = "vllm"
PROFILE_LEGACY: Final = "legacy"
PROFILES: tuple[str, ...] = (PROFILE_VLLM, PROFILE_LEGACY)
DEFAULT_PROFILE: Final = PROFILE_VLLM
#: The KV cache group of events that name none: kvoffload has one group, and
#: vLLM 0.33 always sends ``group_idx`` on its block events.
DEFAULT_GROUP_IDX = 0

# kvoffload medium -> (vLLM medium, vLLM locality). Media not listed pass
# through unchanged with no locality.
_VLLM_MEDIUM: dict[str, tuple[str, str | None]] = {
    MEDIUM_GPU: (MEDIUM_GPU, None),
    MEDIUM_CPU: (MEDIUM_CPU, None),
    MEDIUM_DISK: (MEDIUM_STORAGE, LOCALITY_LOCAL),
    MEDIUM_REMOTE: (MEDIUM_STORAGE, LOCALITY_REMOTE),
}


#: What a stream of block events describes (see ``kvoffload.events``): "exact",
#: the set of hashes each tier holds (the default), or "per-copy", vLLM 0.33's
#: one event per cached / evicted copy.
EVENTS_EXACT: Final = "exact"
EVENTS_PER_COPY: Final = "per-copy"
EVENTS_MODES: tuple[str, ...] = (EVENTS_EXACT, EVENTS_PER_COPY)


def check_events_mode(mode: str) -> str:
    """``mode`` if it names an events mode, else a one-line ValueError."""
    if mode not in EVENTS_MODES:
        known = ", ".join(EVENTS_MODES)
        raise ValueError(f"unknown KV events mode {mode!r}; choose one of {known}")
    return mode


def check_profile(profile: str) -> str:
    """``profile`` if it names a wire profile, else a one-line ValueError."""
    if profile not in PROFILES:
        raise ValueError(
            f"unknown KV events format {profile!r}; choose one of {', '.join(PROFILES)}"
        )
    return profile


# -- the structs the engine builds and subscribers get --------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[object]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """A run of consecutive blocks of one chain became resident in ``medium``.

    ``parent_block_hash`` is the hash of the block before the first one here
    (None at the start of a chain). Secondary tiers send ``block_size=0`` and
    no token ids: consumers take those from the GPU tier's event. The fields
    after ``lora_name`` are vLLM 0.33's optional ones; they travel only in the
    ``"vllm"`` profile, and only when set.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]  # type: ignore[assignment]


def kvoffload_medium(event: BlockStored | BlockRemoved) -> str | None:
    """The kvoffload tier an event (of either profile) is about.

    "STORAGE" is the disk tier, or the remote tier when ``locality`` says
    REMOTE; other media are returned as they are.
    """
    if event.medium == MEDIUM_STORAGE:
        return MEDIUM_REMOTE if event.locality == LOCALITY_REMOTE else MEDIUM_DISK
    return event.medium


# -- the wire profiles: one table per event type drives both ----------------


def vllm_int_hashes_from_env() -> bool:
    """vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default on)."""
    raw = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    try:
        return bool(int(raw))
    except ValueError:
        return True


def vllm_block_hash(value: ExternalBlockHash, int_hashes: bool = True) -> ExternalBlockHash:
    """A hash as vLLM 0.33 publishes it: the low 64 bits of the big-endian bytes.

    ``int.from_bytes(h, "big") & (2**64 - 1)`` is the int of ``h``'s last 8
    bytes, which is cheaper to compute.
    """
    if int_hashes and value.__class__ is bytes:
        return int.from_bytes(value[-8:], "big")
    return value


def _vllm_hashes(values: list[ExternalBlockHash], int_hashes: bool) -> list[ExternalBlockHash]:
    if not int_hashes:
        return values
    return [int.from_bytes(v[-8:], "big") if v.__class__ is bytes else v for v in values]


def _vllm_group(group: int | None, _int_hashes: bool) -> int:
    return DEFAULT_GROUP_IDX if group is None else group


def _vllm_place(medium: str | None, locality: str | None) -> tuple[str | None, str | None]:
    if medium is None:
        return None, locality
    name, where = _VLLM_MEDIUM.get(medium, (medium, None))
    return name, locality if locality is not None else where


#: How the vllm profile writes a field's value, where it differs from the
#: event's (``medium`` and ``locality`` go together, see ``_vllm_place``).
_VLLM_VALUES: dict[str, Callable[[Any, bool], Any]] = {
    "block_hashes": _vllm_hashes,
    "parent_block_hash": vllm_block_hash,
    "group_idx": _vllm_group,
}


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM 0.33's events: maps, optional fields omitted when None."""


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """kvoffload's earlier events: tagged arrays, trailing defaults omitted."""


class _Wire(NamedTuple):
    """One event type on the wire, both profiles (built by :func:`_wire`)."""

    vllm: type[msgspec.Struct]
    legacy: type[msgspec.Struct]
    #: The event's field count and its first ``core`` fields (see ``_wire``).
    width: int
    core: int
    #: (field index, how the vllm profile writes it).
    vllm_values: tuple[tuple[int, Callable[[Any, bool], Any]], ...]
    #: Indices of ``medium`` and ``locality``, or None for an event without a medium.
    place: tuple[int, int] | None


def _wire(event: type[KVCacheEvent], core_until: str | None) -> _Wire:
    """The wire table of ``event``: its struct is the field list, ``core_until``
    its last core field (None: no field is).

    The core fields are those both profiles always carry: the
    legacy profile's positional layout (with the event's own defaults, so
    trailing defaults are left off) and the fields vLLM declares without a
    default (sent even when None). The fields after them are vLLM 0.33's
    optional ones: the vllm profile sends them only when set, the legacy
    profile never. Both wire structs keep the event's field order, so an
    event and its wire structs convert positionally.
    """
    fields = msgspec.structs.fields(event)
    names = [f.name for f in fields]
    core = 0 if core_until is None else names.index(core_until) + 1
    name = event.__name__
    vllm_fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (f.name, f.type) if i < core else (f.name, f.type, None) for i, f in enumerate(fields)
    ]
    legacy_fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (f.name, f.type) if f.default is msgspec.NODEFAULT else (f.name, f.type, f.default)
        for f in fields[:core]
    ]
    return _Wire(
        vllm=msgspec.defstruct(
            f"_Vllm{name}", vllm_fields, bases=(_VllmEvent,), tag=name, module=__name__
        ),
        legacy=msgspec.defstruct(
            f"_Legacy{name}", legacy_fields, bases=(_LegacyEvent,), tag=name, module=__name__
        ),
        width=len(fields),
        core=core,
        vllm_values=tuple((names.index(n), fix) for n, fix in _VLLM_VALUES.items() if n in names),
        place=(names.index("medium"), names.index("locality")) if "medium" in names else None,
    )


#: The table: every event type and its last core field.
_WIRES: dict[type[KVCacheEvent], _Wire] = {
    BlockStored: _wire(BlockStored, core_until="lora_name"),
    BlockRemoved: _wire(BlockRemoved, core_until="medium"),
    AllBlocksCleared: _wire(AllBlocksCleared, core_until=None),
}
_EVENT_OF_WIRE: dict[type[msgspec.Struct], type[KVCacheEvent]] = {
    cls: event for event, wire in _WIRES.items() for cls in (wire.vllm, wire.legacy)
}


def _batch(name: str, events: list[type[msgspec.Struct]]) -> type[msgspec.Struct]:
    """A wire batch: :class:`EventBatch` with its events typed as ``events``."""
    listed = list.__class_getitem__(functools.reduce(operator.or_, events))
    return msgspec.defstruct(name, [("events", listed)], bases=(EventBatch,), module=__name__)


_VllmBatch = _batch("_VllmBatch", [wire.vllm for wire in _WIRES.values()])
_LegacyBatch = _batch("_LegacyBatch", [wire.legacy for wire in _WIRES.values()])


def _wire_of(event: KVEvent) -> _Wire:
    """The table row of an event's class, or of the event type it derives from."""
    for cls in event.__class__.__mro__:
        if cls in _WIRES:
            return _WIRES[cls]
    raise TypeError(f"not a KV event: {event!r}")


def _to_vllm(event: KVEvent, int_hashes: bool) -> msgspec.Struct:
    # Runs on the socket thread for every event sent: positional, no lookups by name.
    wire = _WIRES.get(event.__class__) or _wire_of(event)
    values = list(msgspec.structs.astuple(event))
    if len(values) != wire.width:
        del values[wire.width :]
    for at, write in wire.vllm_values:
        values[at] = write(values[at], int_hashes)
    place = wire.place
    if place is not None:
        values[place[0]], values[place[1]] = _vllm_place(values[place[0]], values[place[1]])
    return wire.vllm(*values)


def _to_legacy(event: KVEvent) -> msgspec.Struct:
    wire = _WIRES.get(event.__class__) or _wire_of(event)
    return wire.legacy(*msgspec.structs.astuple(event)[: wire.core])


def _from_wire(event: msgspec.Struct) -> KVEvent:
    cls: Any = _EVENT_OF_WIRE[event.__class__]
    decoded: KVEvent = cls(*msgspec.structs.astuple(event))
    return decoded


# -- encoding and decoding -------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_vllm_decoder = msgspec.msgpack.Decoder(_VllmBatch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)


def to_wire(
    batch: KVEventBatch, profile: str = DEFAULT_PROFILE, *, int_hashes: bool | None = None
) -> msgspec.Struct:
    """``batch`` as the struct a profile puts on the wire.

    ``int_hashes`` (vllm profile only): None follows the environment as vLLM
    does. In the vllm profile a batch without a rank is sent as rank 0, the
    rank vLLM's publisher stamps by default.
    """
    if profile == PROFILE_VLLM:
        ints = vllm_int_hashes_from_env() if int_hashes is None else int_hashes
        rank = batch.data_parallel_rank
        return _VllmBatch(
            batch.ts, [_to_vllm(e, ints) for e in batch.events], 0 if rank is None else rank
        )
    if profile == PROFILE_LEGACY:
        return _LegacyBatch(
            batch.ts, [_to_legacy(e) for e in batch.events], batch.data_parallel_rank
        )
    check_profile(profile)
    raise AssertionError("unreachable")


def encode_batch(
    batch: KVEventBatch, profile: str = DEFAULT_PROFILE, *, int_hashes: bool | None = None
) -> bytes:
    """The msgpack payload of ``batch`` in ``profile`` (see :func:`to_wire`)."""
    return _encoder.encode(to_wire(batch, profile, int_hashes=int_hashes))


# Try the profile that decoded last first: a stream is nearly always one
# profile, so the other decoder's failed attempt is paid only on a switch.
# The order is an immutable tuple swapped whole, so concurrent decoders each
# see a complete order.
_decoders: tuple[tuple[str, msgspec.msgpack.Decoder], ...] = (
    (PROFILE_VLLM, _vllm_decoder),
    (PROFILE_LEGACY, _legacy_decoder),
)


def decode_batch_profile(payload: bytes) -> tuple[KVEventBatch, str]:
    """Decode a payload of either profile; returns the batch and the profile.

    Raises ``msgspec.DecodeError`` (``ValidationError`` included) when it is
    neither; the error is the vllm profile's.
    """
    global _decoders
    order = _decoders
    errors: dict[str, msgspec.DecodeError] = {}
    for i, (profile, decoder) in enumerate(order):
        try:
            wire: EventBatch = decoder.decode(payload)
        except msgspec.DecodeError as exc:
            errors[profile] = exc
            continue
        if i:
            _decoders = (order[i], *order[:i], *order[i + 1 :])
        events = [_from_wire(cast(msgspec.Struct, e)) for e in wire.events]
        return KVEventBatch(wire.ts, events, wire.data_parallel_rank), profile
    raise errors[PROFILE_VLLM]


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload of either profile (see :func:`decode_batch_profile`)."""
    return decode_batch_profile(payload)[0]
