"""Command-line flags shared by ``kvoffload run`` and ``kvoffload bench serve``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

# OpenMP reads its wait policy once, when torch loads it, so the default must be
# set before the first import below pulls torch in: idle workers then sleep
# instead of spinning, which keeps the engine fast beside a busy process (see
# kvoffload.engine.threads). A value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvoffload.cli import argtypes
from kvoffload.engine.config import KV_LAYOUTS, STORE_MODES, EngineConfig
from kvoffload.offload.policies import policy_menu
from kvoffload.tiers.config import MOONCAKE_KEYS

# Kept for callers that import them from here; the checks live in argtypes.
positive_int = argtypes.positive_int()
byte_size = argtypes.byte_size()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags in three groups (engine, offload, events), defaults from
    ``EngineConfig``."""
    defaults = EngineConfig()
    _add_model_flags(parser.add_argument_group("engine"), defaults)
    _add_offload_flags(parser.add_argument_group("offload"), defaults)
    _add_events_flags(parser.add_argument_group("events"), defaults)


def _add_model_flags(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The model, the GPU tier and the batch."""
    g.add_argument(
        "--model",
        dest="model_path",
        type=argtypes.existing_dir,
        default=None,
        help="local dir with config.json + *.safetensors (Llama/Qwen2); "
        "default: the embedded random model",
    )
    g.add_argument("--seed", type=argtypes.any_int(2**32 - 1, 0), default=d.seed)
    g.add_argument("--block-size", type=argtypes.positive_int(1 << 16), default=d.block_size)
    g.add_argument(
        "--gpu-blocks",
        dest="num_gpu_blocks",
        type=argtypes.positive_int(1 << 32, minimum=2),
        default=d.num_gpu_blocks,
        help="GPU-tier size in blocks",
    )
    g.add_argument("--max-num-seqs", type=argtypes.positive_int(1 << 16), default=d.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=argtypes.positive_int(1 << 24),
        default=d.max_num_batched_tokens,
    )
    g.add_argument("--kv-layout", choices=KV_LAYOUTS, default=d.kv_layout)
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "float64"),
        default=d.dtype,
        help="compute and KV dtype of the model (a checkpoint is cast to it)",
    )
    g.add_argument(
        "--hash-fn",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "xxhash64"),
        default=d.hash_fn,
    )
    g.add_argument(
        "--hash-seed",
        default=d.hash_seed,
        help="seed of the block-hash chains (vLLM's PYTHONHASHSEED role; default: "
        "$PYTHONHASHSEED, else the hash function's fixed default)",
    )
    g.add_argument(
        "--threads",
        dest="num_threads",
        type=argtypes.positive_int(1 << 10),
        default=d.num_threads,
        help="torch threads for the model (default: 1; its GEMMs are too small to gain "
        "from more, and one thread keeps its speed beside a busy process)",
    )


def _add_offload_flags(o: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The CPU tier, its policy and the lower tiers."""
    o.add_argument(
        "--store-mode",
        choices=STORE_MODES,
        default=d.store_mode,
        help="off: no offload; eager: store blocks as computed; lazy: store "
        "blocks about to be evicted",
    )
    o.add_argument(
        "--cpu-blocks",
        dest="num_cpu_blocks",
        type=argtypes.positive_int(1 << 40),
        default=d.num_cpu_blocks,
        help="CPU-tier size in blocks",
    )
    o.add_argument(
        "--cpu-bytes",
        type=byte_size,
        default=None,
        help="CPU-tier byte budget (e.g. 256MiB); overrides --cpu-blocks",
    )
    o.add_argument(
        "--policy",
        dest="cache_policy",
        default=None,
        help="CPU-tier cache policy: "
        + "; ".join(policy_menu().replace("%", "%%").splitlines())
        + ". Figures per trace family against vLLM's own policies: README, Cache policy "
        "(kvoffload bench offload --suite)",
    )
    o.add_argument(
        "--disk-dir",
        type=argtypes.non_empty_path,
        default=None,
        help="directory for a disk tier behind the CPU",
    )
    o.add_argument(
        "--disk-blocks",
        dest="num_disk_blocks",
        type=argtypes.positive_int(1 << 40),
        default=d.num_disk_blocks,
    )
    o.add_argument(
        "--disk-bytes",
        type=byte_size,
        default=None,
        help="disk-tier byte budget (e.g. 1TiB); overrides --disk-blocks",
    )
    o.add_argument(
        "--redis-url",
        type=argtypes.redis_url,
        default=None,
        help="redis://host:port/db for a shared remote tier",
    )
    _add_mooncake_flags(o, d)
    o.add_argument(
        "--write-through",
        action="store_true",
        help="write every store to the lower tiers too (default: write-back)",
    )


def _mooncake(key: str) -> Callable[[str], Any]:
    """An argparse type checking one Mooncake key as ``TierConfig`` does (one-line errors)."""

    def parse(text: str) -> Any:
        from kvoffload.tiers.mooncake import settings

        try:
            return settings.check({key: text})[key]
        except settings.MooncakeSettingError as exc:
            raise argparse.ArgumentTypeError(exc.why) from None

    return parse


def _add_mooncake_flags(o: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The Mooncake Store tier (``kvoffload.tiers.mooncake.settings``)."""
    o.add_argument(
        "--mooncake-url",
        type=_mooncake("mooncake_url"),
        default=None,
        help="mooncakestore://HOST:PORT: a Mooncake Store master for a shared remote tier "
        "(instead of --redis-url)",
    )
    o.add_argument(
        "--mooncake-namespace", type=_mooncake("mooncake_namespace"), default=d.mooncake_namespace
    )
    o.add_argument(
        "--mooncake-metadata",
        type=_mooncake("mooncake_metadata"),
        default=d.mooncake_metadata,
        help="the transfer engine's metadata: P2PHANDSHAKE, or an http:// / etcd:// server",
    )
    o.add_argument("--mooncake-protocol", choices=("tcp", "rdma"), default=d.mooncake_protocol)
    o.add_argument(
        "--mooncake-segment-bytes",
        type=_mooncake("mooncake_segment_bytes"),
        default=d.mooncake_segment_bytes,
        help="memory this process contributes to the pool (e.g. 1GiB; 0: a pure client of "
        "other holders, the default)",
    )
    o.add_argument(
        "--mooncake-local-buffer-bytes",
        type=_mooncake("mooncake_local_buffer_bytes"),
        default=d.mooncake_local_buffer_bytes,
        help="the Mooncake client's own transfer buffer",
    )


def _add_events_flags(e: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Publishing KV events."""
    e.add_argument(
        "--events-endpoint",
        type=argtypes.zmq_endpoint,
        default=None,
        help="publish KV events on this ZMQ PUB endpoint, e.g. tcp://*:5557",
    )
    e.add_argument("--events-replay-endpoint", type=argtypes.zmq_endpoint, default=None)
    e.add_argument(
        "--events-format",
        choices=("vllm", "legacy"),
        default=d.events_format,
        help="wire profile of published events: vllm (0.33's) or legacy (positional)",
    )
    e.add_argument(
        "--events-mode",
        choices=("exact", "per-copy"),
        default=d.events_mode,
        help="exact: each tier's events describe the set of hashes it holds (a router keeps "
        "one entry per hash); per-copy: vLLM's one event per cached or evicted GPU copy",
    )
    e.add_argument(
        "--events-self-describing",
        action=argparse.BooleanOptionalAction,
        default=d.events_self_describing,
        help="CPU and disk stores carry token ids, parent hash and block size (vLLM's "
        "self_describing_kv_events), so a router indexes every tier",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    fields = {
        name: getattr(args, name)
        for name in (
            "model_path",
            "seed",
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_layout",
            "dtype",
            "hash_fn",
            "store_mode",
            "num_cpu_blocks",
            "cpu_bytes",
            "cache_policy",
            "disk_dir",
            "num_disk_blocks",
            "disk_bytes",
            "redis_url",
            *MOONCAKE_KEYS,
            "write_through",
            "events_endpoint",
            "events_replay_endpoint",
            "events_format",
            "events_mode",
            "events_self_describing",
            "hash_seed",
            "num_threads",
        )
    }
    fields.update(overrides)
    config = EngineConfig(**fields)
    from kvoffload.cli.preflight import check_engine_config

    check_engine_config(config)  # refuse what cannot work before allocating anything
    return config
