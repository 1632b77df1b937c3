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

from typing import Any

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
        if is_eagle_group or getattr(spec, "is_draft", False):
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
