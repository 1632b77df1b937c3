"""Checks an engine configuration against the machine before anything is allocated.

A GPU or CPU tier too large for memory is refused in one line here, instead of
surfacing as an allocator error (or the OOM killer) during start-up.
"""

from __future__ import annotations

from kvoffload.cli.argtypes import check_fits_in_memory
from kvoffload.engine.config import EngineConfig


def kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one KV block of the configured model (all layers, K and V)."""
    from kvoffload.engine.model_runner import _model_config
    from kvoffload.transfer.layout import KVGeometry, parse_dtype

    mc = _model_config(config)
    dtype = parse_dtype(config.dtype) if config.model_path is None else mc.torch_dtype
    geometry = KVGeometry(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_size=mc.head_dim,
        block_size=config.block_size,
        dtype=dtype,
    )
    return int(geometry.bytes_per_block)


def engine_memory_bytes(config: EngineConfig) -> int:
    """Bytes the engine's KV tiers take in memory: the GPU tier and, with offload, the CPU tier."""
    per_block = kv_bytes_per_block(config)
    total = config.num_gpu_blocks * per_block
    if config.offload_enabled:
        total += (
            config.cpu_bytes
            if config.cpu_bytes is not None
            else (config.num_cpu_blocks * per_block)
        )
    return total


def check_engine_memory(config: EngineConfig) -> None:
    """``ValueError`` naming the sizes when the KV tiers would not fit in available memory."""
    what = (
        f"the KV cache ({config.num_gpu_blocks:,} GPU blocks of {config.block_size:,} tokens"
        + (
            f" + a CPU tier of {config.cpu_bytes:,} bytes"
            if config.offload_enabled and config.cpu_bytes is not None
            else f" + {config.num_cpu_blocks:,} CPU blocks"
            if config.offload_enabled
            else ""
        )
        + ")"
    )
    check_fits_in_memory(what, engine_memory_bytes(config))
