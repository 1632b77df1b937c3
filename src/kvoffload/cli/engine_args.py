"""Command-line flags shared by ``kvoffload run`` and ``kvoffload bench serve``."""

from __future__ import annotations

import argparse

from kvoffload.engine.config import KV_LAYOUTS, STORE_MODES, EngineConfig


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def byte_size(text: str) -> int:
    from kvoffload.transfer.sizing import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        dest="model_path",
        default=None,
        help="local dir with config.json + *.safetensors (Llama/Qwen2); "
        "default: the embedded random model",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--block-size", type=positive_int, default=d.block_size)
    g.add_argument(
        "--gpu-blocks",
        dest="num_gpu_blocks",
        type=positive_int,
        default=d.num_gpu_blocks,
        help="GPU-tier size in blocks",
    )
    g.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens)
    g.add_argument("--kv-layout", choices=KV_LAYOUTS, default=d.kv_layout)
    g.add_argument("--hash-fn", choices=("xxhash64", "sha256_cbor"), default=d.hash_fn)
    o = parser.add_argument_group("offload")
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
        type=positive_int,
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
        help="CPU-tier cache policy (default: the best measured one)",
    )
    o.add_argument("--disk-dir", default=None, help="directory for a disk tier behind the CPU")
    o.add_argument(
        "--disk-blocks", dest="num_disk_blocks", type=positive_int, default=d.num_disk_blocks
    )
    o.add_argument(
        "--redis-url", default=None, help="redis://host:port/db for a shared remote tier"
    )
    o.add_argument(
        "--write-through",
        action="store_true",
        help="write every store to the lower tiers too (default: write-back)",
    )
    e = parser.add_argument_group("events")
    e.add_argument(
        "--events-endpoint",
        default=None,
        help="publish KV events on this ZMQ PUB endpoint, e.g. tcp://*:5557",
    )
    e.add_argument("--events-replay-endpoint", default=None)


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
            "hash_fn",
            "store_mode",
            "num_cpu_blocks",
            "cpu_bytes",
            "cache_policy",
            "disk_dir",
            "num_disk_blocks",
            "redis_url",
            "write_through",
            "events_endpoint",
            "events_replay_endpoint",
        )
    }
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]
