"""A seeded multi-turn chat workload: the trace the offload benchmarks replay.

Shape of the trace (all token ids, nothing model-specific):

- ``num_system_prompts`` shared system prompts; every conversation starts with
  one of them (picked with Zipf popularity), so the first blocks of many
  chains are shared;
- ``num_conversations`` conversation *slots* with Zipf popularity (slot of
  rank r is picked with probability proportional to 1 / r**zipf_s, ranks
  shuffled by the seed); each pick is the slot's next turn;
- a turn's prompt is the conversation so far (system prompt, earlier user
  messages and replies) plus a new user message, so every turn extends the
  previous turn's prompt and reuses its whole prefix;
- the reply (``output_token_ids``) is scripted, so a replay knows which blocks
  the turn's decode would produce; the next turn's prompt contains it;
- a conversation that reached its turn budget or ``max_context_tokens`` ends,
  and its slot starts a fresh conversation on its next pick (a new
  ``conversation_id`` and new tokens, same popularity).

The same config and seed always give the same trace. Block hashes come from
``kvoffload.hashing`` (``request_block_hashes``, or ``TraceHasher`` which
hashes a conversation incrementally, turn after turn).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from kvoffload.hashing import BlockHash, BlockHasher, HashFunction, hash_request_tokens, xxhash64


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the trace; ranges are inclusive ``(low, high)`` token counts."""

    num_requests: int = 2000
    num_conversations: int = 200
    num_system_prompts: int = 4
    system_prompt_tokens: int = 1024
    user_tokens: tuple[int, int] = (32, 256)
    output_tokens: tuple[int, int] = (32, 256)
    turns: tuple[int, int] = (2, 12)
    max_context_tokens: int = 8192
    zipf_s: float = 1.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_conversations", "num_system_prompts", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {self.system_prompt_tokens}")
        for name in ("user_tokens", "output_tokens", "turns"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)}")
        if (
            self.max_context_tokens
            < self.system_prompt_tokens + self.user_tokens[1] + self.output_tokens[0]
        ):
            raise ValueError(
                "max_context_tokens must fit the system prompt, one user message and one "
                f"reply, got {self.max_context_tokens}"
            )
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")


@dataclass(frozen=True)
class TraceRequest:
    """One turn: send ``prompt_token_ids``, the model replies ``output_token_ids``.

    ``prompt_token_ids`` starts with the previous turn's prompt and reply of the
    same ``conversation_id`` (whole, token for token).
    """

    req_id: str
    conversation_id: int
    turn: int  # 0 for a conversation's first request
    system_prompt_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class _Conversation:
    conversation_id: int
    system_prompt_id: int
    history: list[int]
    turns_left: int
    turn: int = 0


def zipf_cdf(n: int, s: float) -> list[float]:
    """Cumulative Zipf(s) weights over ranks 1..n, normalised to end at 1."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(weights)
    return (cdf / cdf[-1]).tolist()


def generate_trace(config: WorkloadConfig | None = None) -> Iterator[TraceRequest]:
    """Yield ``config.num_requests`` turns, deterministically from ``config.seed``."""
    cfg = config or WorkloadConfig()
    rng = np.random.default_rng(cfg.seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, cfg.vocab_size, n).tolist()

    def length(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    system_prompts = [tokens(cfg.system_prompt_tokens) for _ in range(cfg.num_system_prompts)]
    prompt_cdf = zipf_cdf(cfg.num_system_prompts, cfg.zipf_s)
    slot_cdf = zipf_cdf(cfg.num_conversations, cfg.zipf_s)
    slot_of_rank = rng.permutation(cfg.num_conversations).tolist()
    slots: dict[int, _Conversation] = {}
    next_conv_id = itertools.count()

    def pick(cdf: list[float]) -> int:
        return min(bisect.bisect_left(cdf, float(rng.random())), len(cdf) - 1)

    def new_conversation(slot: int) -> _Conversation:
        sp = pick(prompt_cdf)
        conv = _Conversation(next(next_conv_id), sp, list(system_prompts[sp]), length(cfg.turns))
        slots[slot] = conv
        return conv

    for i in range(cfg.num_requests):
        slot = slot_of_rank[pick(slot_cdf)]
        conv = slots.get(slot)
        if conv is None or conv.turns_left == 0:
            conv = new_conversation(slot)
        user = tokens(length(cfg.user_tokens))
        prompt = conv.history + user
        out_len = min(length(cfg.output_tokens), cfg.max_context_tokens - len(prompt))
        if out_len < cfg.output_tokens[0]:
            # The conversation is full: this pick starts a fresh one in the slot.
            conv = new_conversation(slot)
            prompt = conv.history + user
            out_len = min(length(cfg.output_tokens), cfg.max_context_tokens - len(prompt))
        output = tokens(out_len)
        yield TraceRequest(
            req_id=f"req-{i}",
            conversation_id=conv.conversation_id,
            turn=conv.turn,
            system_prompt_id=conv.system_prompt_id,
            prompt_token_ids=prompt,
            output_token_ids=output,
        )
        conv.history = prompt + output
        conv.turn += 1
        conv.turns_left -= 1


def continuing_request_ids(trace: Iterable[TraceRequest]) -> set[str]:
    """The turns whose conversation has a later turn in ``trace``: all but each one's last.

    A replay passes these as session hints (``continues=True``). The trace's own
    future decides, so a conversation cut off by the end of the trace ends there.
    """
    last: dict[int, str] = {}
    ids: list[str] = []
    for req in trace:
        last[req.conversation_id] = req.req_id
        ids.append(req.req_id)
    final = set(last.values())
    return {i for i in ids if i not in final}


def iter_prompts(config: WorkloadConfig | None = None) -> Iterator[list[int]]:
    """Just the prompts of ``generate_trace(config)``, as token-id lists."""
    for req in generate_trace(config):
        yield req.prompt_token_ids


def request_block_hashes(
    token_ids: list[int] | TraceRequest,
    block_size: int,
    hash_fn: HashFunction = xxhash64,
    include_output: bool = False,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of a request (its prompt, or prompt + reply)."""
    if isinstance(token_ids, TraceRequest):
        token_ids = token_ids.all_token_ids if include_output else token_ids.prompt_token_ids
    return hash_request_tokens(token_ids, block_size, hash_fn)


class TraceHasher:
    """Hashes a trace's requests incrementally, one ``BlockHasher`` per conversation.

    A turn re-sends its conversation's whole history, so hashing each request
    from scratch is quadratic in the conversation's length; this keeps the
    hashes of the conversation so far and hashes only the new full blocks.
    Results equal ``request_block_hashes``. A conversation's hasher is
    dropped when its slot moves on (``max_live`` conversations are kept).
    """

    def __init__(
        self, block_size: int, hash_fn: HashFunction = xxhash64, max_live: int = 100_000
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.max_live = max_live
        self._hashers: dict[int, BlockHasher] = {}

    def hashes(self, req: TraceRequest) -> tuple[list[BlockHash], list[BlockHash]]:
        """``(prompt block hashes, prompt + reply block hashes)``; the first is a prefix."""
        hasher = self._hashers.pop(req.conversation_id, None)
        if hasher is None or len(hasher.block_hashes) * self.block_size > len(req.prompt_token_ids):
            hasher = BlockHasher(self.block_size, self.hash_fn)
        self._hashers[req.conversation_id] = hasher  # most recent last
        if len(self._hashers) > self.max_live:
            del self._hashers[next(iter(self._hashers))]
        hasher.update(req.prompt_token_ids)
        n_prompt = len(hasher.block_hashes)
        hasher.update(req.all_token_ids)
        full = list(hasher.block_hashes)
        return full[:n_prompt], full
