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

import os
from typing import Any, Final, Literal

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


# -- the "vllm" profile: vLLM 0.33's structs, field for field ------------------


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    # No defaults: vLLM always sends these three.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_VllmBlockStored | _VllmBlockRemoved | _VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


# -- the "legacy" profile: kvoffload's earlier positional layout --------------


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


# -- conversion --------------------------------------------------------------------


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
        return int.from_bytes(value[-8:], "big")  # type: ignore[index]
    return value


def _vllm_hashes(values: list[ExternalBlockHash], int_hashes: bool) -> list[ExternalBlockHash]:
    if not int_hashes:
        return values
    return [int.from_bytes(v[-8:], "big") if v.__class__ is bytes else v for v in values]  # type: ignore[index]


def _vllm_place(medium: str | None, locality: str | None) -> tuple[str | None, str | None]:
    if medium is None:
        return None, locality
    name, where = _VLLM_MEDIUM.get(medium, (medium, None))
    return name, locality if locality is not None else where


# Per-event conversion runs on the socket thread for every event sent, so it
# builds the common case positionally and sets vLLM's optional fields only
# when the event has any.
_STORED_EXTRAS = (
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)


def _to_vllm(event: KVEvent, int_hashes: bool) -> _VllmEvent:
    cls = event.__class__
    if cls is BlockStored or isinstance(event, BlockStored):
        stored: BlockStored = event  # type: ignore[assignment]
        medium, locality = _vllm_place(stored.medium, stored.locality)
        parent = stored.parent_block_hash
        group = stored.group_idx
        out = _VllmBlockStored(
            _vllm_hashes(stored.block_hashes, int_hashes),
            None if parent is None else vllm_block_hash(parent, int_hashes),
            stored.token_ids,
            stored.block_size,
            stored.lora_id,
            medium,
            stored.lora_name,
            stored.extra_keys,
            DEFAULT_GROUP_IDX if group is None else group,
        )
        if locality is not None:
            out.locality = locality
        if not (
            stored.kv_cache_spec_kind is None
            and stored.kv_cache_spec_sliding_window is None
            and stored.ownership is None
            and stored.session_id is None
            and stored.lookahead_token_ids is None
        ):
            for name in _STORED_EXTRAS:
                setattr(out, name, getattr(stored, name))
        return out
    if cls is BlockRemoved or isinstance(event, BlockRemoved):
        removed: BlockRemoved = event  # type: ignore[assignment]
        medium, locality = _vllm_place(removed.medium, removed.locality)
        group = removed.group_idx
        return _VllmBlockRemoved(
            _vllm_hashes(removed.block_hashes, int_hashes),
            medium,
            DEFAULT_GROUP_IDX if group is None else group,
            locality,
            removed.ownership,
        )
    if cls is AllBlocksCleared or isinstance(event, AllBlocksCleared):
        return _VllmAllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


def _to_legacy(event: KVEvent) -> _LegacyEvent:
    if isinstance(event, BlockStored):
        return _LegacyBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return _LegacyBlockRemoved(event.block_hashes, event.medium)
    if isinstance(event, AllBlocksCleared):
        return _LegacyAllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


def _from_wire(event: _VllmEvent | _LegacyEvent) -> KVEvent:
    if isinstance(event, _VllmBlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.locality,
            event.ownership,
            event.session_id,
            event.lookahead_token_ids,
        )
    if isinstance(event, _VllmBlockRemoved):
        return BlockRemoved(
            event.block_hashes, event.medium, event.group_idx, event.locality, event.ownership
        )
    if isinstance(event, _LegacyBlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        )
    if isinstance(event, _LegacyBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


# -- encoding and decoding -------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_vllm_decoder = msgspec.msgpack.Decoder(_VllmBatch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)


def to_wire(
    batch: KVEventBatch, profile: str = DEFAULT_PROFILE, *, int_hashes: bool | None = None
) -> _VllmBatch | _LegacyBatch:
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
            wire: _VllmBatch | _LegacyBatch = decoder.decode(payload)
        except msgspec.DecodeError as exc:
            errors[profile] = exc
            continue
        if i:
            _decoders = (order[i], *order[:i], *order[i + 1 :])
        events = [_from_wire(e) for e in wire.events]
        return KVEventBatch(wire.ts, events, wire.data_parallel_rank), profile
    raise errors[PROFILE_VLLM]


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload of either profile (see :func:`decode_batch_profile`)."""
    return decode_batch_profile(payload)[0]
