"""Engine configuration, validated up front so bad values fail before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffload.tiers.config import TierConfig

STORE_MODES = ("off", "eager", "lazy")
KV_LAYOUTS = ("layer_first", "kv_split", "cross_layer")


@dataclass
class EngineConfig:
    """Everything the reference engine needs; defaults are the embedded demo.

    ``num_gpu_blocks`` is deliberately small by default: the point of the demo
    is a GPU tier that cannot hold the working set.
    """

    model_path: str | None = None  # local dir of safetensors + config.json; None = random model
    seed: int = 0
    dtype: str = "float32"
    block_size: int = 16
    num_gpu_blocks: int = 96
    max_num_seqs: int = 8
    # A prompt of the demo (about 290 tokens) spans several steps of this budget, as a
    # real prompt spans several chunks of a real server's budget; with one step per
    # prompt, an asynchronous load's extra step would cost more TTFT than it saves.
    max_num_batched_tokens: int = 64
    kv_layout: str = "layer_first"
    hash_fn: str = "sha256"  # vLLM 0.33's default: mixed fleets share hashes
    # NONE_HASH seed (vLLM's PYTHONHASHSEED role); None = the environment's, else
    # the hash function's fixed default (random per process for non-crypto hashes).
    hash_seed: str | None = None
    # Offload tier
    store_mode: str = "eager"  # off | eager | lazy
    cpu_bytes: int | None = None  # CPU tier byte budget; None = num_cpu_blocks
    num_cpu_blocks: int = 1024
    cache_policy: str | None = None  # None = the manager's default
    lazy_window_blocks: int | None = None  # None = one step's worth of blocks
    disk_dir: str | None = None
    disk_bytes: int | None = None
    num_disk_blocks: int = 8192
    redis_url: str | None = None
    # A Mooncake Store master (mooncakestore://HOST:PORT) and its knobs (TierConfig's keys).
    mooncake_url: str | None = None
    mooncake_namespace: str = "kvoffload"
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_protocol: str = "tcp"
    mooncake_segment_bytes: int = 0
    mooncake_local_buffer_bytes: int = 16 << 20
    write_through: bool = False
    # KV events
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str | None = None  # None = the publisher's default (vLLM's: "")
    events_format: str = "vllm"  # wire profile: "vllm" (0.33's) or "legacy"
    # "exact": each tier's stream is the set of hashes it holds; "per-copy": vLLM's
    # one event per cached / evicted GPU copy (see kvoffload.events).
    events_mode: str = "exact"
    # Offloaded tiers' stores carry token ids, parent, block size, LoRA and extra keys
    # (vLLM 0.33's self_describing_kv_events), so a router indexes every tier.
    events_self_describing: bool = True
    # Verification: keep every sampled logits row on its RequestOutput (costs a
    # vocab-sized copy per token; off by default).
    record_logits: bool = False
    # torch intra-op threads for the model; None = kvoffload.engine.threads decides.
    num_threads: int | None = None
    # Worker
    transfer_threads: int = 2

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")

        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_cpu_blocks",
            "num_disk_blocks",
            "transfer_threads",
        ):
            positive(name)
        if self.num_gpu_blocks < 2:
            raise ValueError("EngineConfig.num_gpu_blocks must be >= 2 (block 0 is the null block)")
        if self.store_mode not in STORE_MODES:
            raise ValueError(
                f"EngineConfig.store_mode must be one of {', '.join(STORE_MODES)}, "
                f"got {self.store_mode!r}"
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"EngineConfig.kv_layout must be one of {', '.join(KV_LAYOUTS)}, "
                f"got {self.kv_layout!r}"
            )
        if self.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"EngineConfig.dtype {self.dtype!r} is not supported")
        if self.lazy_window_blocks is not None:
            positive("lazy_window_blocks")
        if self.num_threads is not None:
            positive("num_threads")
        if self.hash_seed is not None and not isinstance(self.hash_seed, str):
            raise ValueError(
                f"EngineConfig.hash_seed must be a string or None, got {self.hash_seed!r}"
            )
        if self.disk_bytes is not None and self.disk_dir is None:
            raise ValueError("EngineConfig.disk_bytes needs disk_dir (the disk tier's directory)")
        if self.has_lower_tiers:
            self.tier_config()  # checks the lower tiers' settings now, before any work
        from kvoffload.events.types import check_events_mode, check_profile

        try:
            check_profile(self.events_format)
        except ValueError as exc:
            raise ValueError(f"EngineConfig.events_format: {exc}") from None
        try:
            check_events_mode(self.events_mode)
        except ValueError as exc:
            raise ValueError(f"EngineConfig.events_mode: {exc}") from None

    @property
    def has_lower_tiers(self) -> bool:
        return any(x is not None for x in (self.disk_dir, self.redis_url, self.mooncake_url))

    def tier_config(self) -> TierConfig | None:
        """The lower tiers as one ``TierConfig`` (None: CPU tier only).

        ``disk_bytes`` wins over ``num_disk_blocks`` when both are set.
        """
        from kvoffload.tiers.config import TierConfig

        if not self.has_lower_tiers:
            return None
        return TierConfig(
            disk_dir=self.disk_dir,
            disk_bytes=self.disk_bytes if self.disk_dir else None,
            disk_blocks=None if self.disk_bytes or not self.disk_dir else self.num_disk_blocks,
            redis_url=self.redis_url,
            mooncake_url=self.mooncake_url,
            mooncake_namespace=self.mooncake_namespace,
            mooncake_metadata=self.mooncake_metadata,
            mooncake_protocol=self.mooncake_protocol,
            mooncake_segment_bytes=self.mooncake_segment_bytes,
            mooncake_local_buffer_bytes=self.mooncake_local_buffer_bytes,
            write_mode="write_through" if self.write_through else "write_back",
            enable_events=self.publishes_events,
            num_threads=self.transfer_threads,
            # Redis presence is asked off the scheduler thread (TierConfig's default): the
            # connector defers a request whose next block is still being asked about.
            where="EngineConfig",
        )

    @property
    def publishes_events(self) -> bool:
        return self.events_endpoint is not None

    @property
    def offload_enabled(self) -> bool:
        return self.store_mode != "off"
