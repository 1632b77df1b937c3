"""The kinds of KV cache group kvoffload offloads inside vLLM, and the one-line refusal of others.

kvoffload offloads what vLLM 0.33's (and 0.32's) own offloading connector
offloads: the prefix-cacheable groups vLLM selects, whose layers are full
attention (MLA, EAGLE / MTP drafter and attention-sink layers included),
sliding window (MLA + sliding window included), chunked local attention or
Mamba / linear attention. vLLM refuses any other kind deep in its start-up
(an assertion without a message while it builds the offloading config, or
``NotImplementedError`` while the worker registers its tensors), and so does
a group that lives in host memory; ``check_offloadable`` refuses the same
configurations first, with one line naming the group and its kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.settings import KVOffloadConfigError


def _spec_classes() -> dict[str, type]:
    from vllm.v1 import kv_cache_interface as kci

    names = (
        "FullAttentionSpec",
        "SlidingWindowSpec",
        "ChunkedLocalAttentionSpec",
        "MambaSpec",
        "MLAAttentionSpec",
        "SlidingWindowMLASpec",
    )
    return {n: getattr(kci, n) for n in names if hasattr(kci, n)}


def group_kind(spec: Any, is_eagle_group: bool = False) -> str:
    """A layer spec's kind as kvoffload names it (``"unsupported:<class>"`` for others)."""
    c = _spec_classes()

    def isa(name: str) -> bool:
        return name in c and isinstance(spec, c[name])

    if isa("SlidingWindowMLASpec"):
        return "mla_sliding_window"
    if isa("SlidingWindowSpec"):
        return "sliding_window"
    if isa("ChunkedLocalAttentionSpec"):
        return "chunked_local"
    if isa("MambaSpec"):
        return f"mamba_{getattr(spec, 'mamba_cache_mode', 'none')}"
    if isa("FullAttentionSpec"):
        if is_eagle_group or compat.is_draft_spec(spec):
            return "drafter"
        return "mla" if isa("MLAAttentionSpec") else "full_attention"
    return f"unsupported:{type(spec).__name__}"


def _layer_specs(group_spec: Any) -> list[Any]:
    per_layer = getattr(group_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return list(per_layer.values()) if isinstance(per_layer, dict) else [group_spec]


def offloaded_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The groups vLLM's offloading connector offloads (its own selection where it has one)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_offloading_group_ids,
        )

        return tuple(get_offloading_group_ids(kv_cache_config))
    except (ImportError, AttributeError):
        return tuple(range(len(kv_cache_config.kv_cache_groups)))


def unsupported_group(kv_cache_config: Any) -> str | None:
    """Why vLLM's offloading cannot take this KV cache layout, in one line; None if it can."""
    for group_id in offloaded_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[group_id]
        if getattr(group, "host_resident", False):
            return f"KV cache group {group_id} lives in host memory (host_resident)"
        eagle = bool(getattr(group, "is_eagle_group", False))
        for spec in _layer_specs(group.kv_cache_spec):
            kind = group_kind(spec, eagle)
            if kind.startswith("unsupported:"):
                return (
                    f"KV cache group {group_id} is of kind {type(spec).__name__}, which vLLM's "
                    "offloading does not support (full attention, sliding window, chunked local, "
                    "Mamba, MLA, drafter groups only)"
                )
    return None


def check_offloadable(kv_cache_config: Any) -> None:
    """``KVOffloadConfigError`` (one line naming the group and its kind) for a layout vLLM's
    offloading refuses; nothing otherwise."""
    why = unsupported_group(kv_cache_config)
    if why is not None:
        raise KVOffloadConfigError(f"kvoffload cannot offload this model: {why}")


# -- what the CPU tier's policy is told of each group ------------------------------------
#
# vLLM hands an OffloadingSpec only its offloading config (no layer specs): the
# window of a group is there (0.33: ``sliding_window_size_in_chunks``), its kind
# is not. KVOffloadConnector, which sees vLLM's KV cache config, hands the exact
# kinds to the spec vLLM builds inside it (``connector_build``); behind vLLM's
# stock connector the spec infers them from the windows.

#: (group id, kind, window in tokens or None).
GroupDescription = tuple[int, str, int | None]


def describe_groups(kv_cache_config: Any) -> tuple[GroupDescription, ...]:
    """(group id, kind, window in tokens or None) of each group vLLM offloads."""
    out = []
    for group_id in offloaded_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = _layer_specs(group.kv_cache_spec)[0]
        kind = group_kind(spec, bool(getattr(group, "is_eagle_group", False)))
        window = getattr(spec, "sliding_window", None) or getattr(
            spec, "attention_chunk_size", None
        )
        out.append((group_id, kind, int(window) if window else None))
    return tuple(out)


def group_layouts(
    config: Any,
    described: Sequence[GroupDescription] | None,
    slot_bytes: Sequence[int],
) -> list[Any]:
    """kvoffload's ``GroupLayout`` per group id (the chunk-unit policy's view of the groups).

    ``slot_bytes[pos]``: bytes of one key of the group at ``pos`` in ``config.groups``.
    Ids vLLM does not offload get the default (full attention); they hold no keys.
    """
    from kvoffload.offload.chunk_units import (
        CHUNKED_LOCAL,
        FULL_ATTENTION,
        MAMBA,
        SLIDING_WINDOW,
        GroupLayout,
    )

    kinds = {gid: (kind, window) for gid, kind, window in (described or ())}
    bpc = int(config.cache.blocks_per_chunk)
    size = max((g.group_id for g in config.groups), default=-1) + 1
    out = [GroupLayout() for _ in range(size)]
    for pos, g in enumerate(config.groups):
        per_chunk = int(g.tokens_per_block) * bpc
        kind, window = kinds.get(g.group_id, (None, None))
        if kind is None:  # behind vLLM's stock connector: the window is all it says
            _, chunks = compat.group_window_chunks(g)
            kind = "full_attention" if chunks is None else "sliding_window"
            window = None if chunks is None else chunks * per_chunk
        if kind in ("sliding_window", "mla_sliding_window") and window:
            mapped, win = SLIDING_WINDOW, window
        elif kind == "chunked_local" and window:
            mapped, win = CHUNKED_LOCAL, window
        elif kind.startswith("mamba"):
            mapped, win = MAMBA, None
        else:
            mapped, win = FULL_ATTENTION, None
        out[g.group_id] = GroupLayout(mapped, win, per_chunk, int(slot_bytes[pos]))
    return out
