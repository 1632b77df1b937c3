"""A request as the reference engine tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvoffload.blocks import KVCacheBlock
from kvoffload.hashing import BlockHash, BlockHasher, HashFunction


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_LOAD = "waiting_for_load"  # tier blocks are being copied in
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_size: int
    hash_fn: HashFunction
    lora_name: str | None = None
    cache_salt: str | None = None
    parent_hash: bytes | None = None  # chain seed; None = the module NONE_HASH
    arrival_time: float = field(default_factory=time.perf_counter)
    continues: bool = False  # session hint: the conversation goes on after this request
    # With lora_name, the adapter's path: hashed as vLLM hashes LoRA requests.
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id}: empty prompt")
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.blocks: list[KVCacheBlock] = []
        self.num_cached_blocks = 0  # blocks registered in the GPU prefix cache
        self.hasher = BlockHasher(
            self.block_size,
            self.hash_fn,
            self.lora_name,
            self.cache_salt,
            self.parent_hash,
            lora_path=self.lora_path,
        )
        self.hasher.update(self.all_token_ids)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        # Set at first admission (stats): where the prompt's prefix came from.
        self.num_gpu_hit_tokens: int | None = None
        self.num_tier_hit_tokens = 0
        self.num_external_tokens = 0  # tokens being loaded right now
        self.num_prefill_tokens_computed = 0
        # The logits row behind each output token, only when the engine records them.
        self.logits_rows: list[object] = []

    @property
    def block_hashes(self) -> list[BlockHash]:
        return self.hasher.block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.hasher.update(self.all_token_ids)

    def should_stop(self) -> bool:
        if len(self.output_token_ids) >= self.sampling.max_tokens:
            return True
        return (
            bool(self.output_token_ids)
            and self.output_token_ids[-1] in self.sampling.stop_token_ids
        )
