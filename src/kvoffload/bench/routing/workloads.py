"""The requests the routing bench sends: the multi-turn chat and the Mooncake trace.

Both become one list of :class:`RouteRequest` (token ids, reply length, a
conversation id for the session hint), the same list for every router.

* ``chat``: ``kvoffload.engine.demo.workload``'s seeded multi-turn chat, shaped as
  ``kvoffload run``'s demo (a turn re-sends the conversation so far).
* ``mooncake``: a Mooncake-format trace (``hash_ids`` per prompt block, equal
  ids meaning equal prefixes). The reference engine cannot serve its 40k-token
  prompts, so each hash id becomes one block of ``block_size`` token ids drawn
  from a generator seeded by the id (equal ids give equal tokens, so the
  trace's prefix sharing is kept exactly) and a prompt keeps its first
  ``max_blocks`` ids (a prefix of its chain: sharing between prompts is kept
  up to that depth). Replies are capped at ``max_output`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvoffload.bench.policy.mooncake import read_mooncake_trace
from kvoffload.engine.demo.workload import continuing_request_ids, generate_trace

DEFAULT_MOONCAKE_TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
WORKLOADS = ("chat", "mooncake")


@dataclass(frozen=True)
class RouteRequest:
    req_id: str
    token_ids: list[int]
    max_tokens: int
    continues: bool = False  # a later request of the same conversation follows


def chat_requests(num_requests: int, vocab_size: int, seed: int = 0) -> list[RouteRequest]:
    """``kvoffload run``'s multi-turn demo workload, ``num_requests`` turns."""
    from kvoffload.engine.demo.serving import demo_workload  # imports the engine (torch)

    trace = list(generate_trace(demo_workload(vocab_size, num_requests, seed=seed)))
    cont = continuing_request_ids(trace)
    return [
        RouteRequest(r.req_id, r.prompt_token_ids, len(r.output_token_ids), r.req_id in cont)
        for r in trace
    ]


def block_tokens(hash_id: int, block_size: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The token ids standing for one Mooncake block: a function of its id alone."""
    rng = np.random.default_rng([seed, hash_id])
    return rng.integers(0, vocab_size, block_size).tolist()


def mooncake_requests(
    path: str | Path,
    num_requests: int,
    block_size: int,
    vocab_size: int,
    max_blocks: int = 16,
    max_output: int = 8,
    seed: int = 0,
    start: int | None = None,
) -> list[RouteRequest]:
    """``num_requests`` consecutive requests of a Mooncake trace from ``start``, scaled down.

    ``start=None`` takes the trace's last ``num_requests``: in the synthetic
    trace prefixes repeat more the further it goes (a window of 300 shares
    1-11% of its blocks within itself in the first half, 58% at the end), and a
    router can only show what it does where requests share prefixes. A request
    with no hash id is skipped, so the list may be shorter than asked.
    """
    if max_blocks < 1 or max_output < 1:
        raise ValueError(
            f"need max_blocks >= 1 and max_output >= 1, got {max_blocks}, {max_output}"
        )
    trace = list(read_mooncake_trace(path))
    first = max(0, len(trace) - num_requests) if start is None else start
    out: list[RouteRequest] = []
    cache: dict[int, list[int]] = {}
    for i, req in enumerate(trace[first : first + num_requests], first):
        ids = req.hash_ids[:max_blocks]
        if not ids:
            continue
        tokens: list[int] = []
        for h in ids:
            block = cache.get(h)
            if block is None:
                block = cache[h] = block_tokens(h, block_size, vocab_size, seed)
            tokens.extend(block)
        out.append(RouteRequest(f"mc-{i}", tokens, max(1, min(req.output_length, max_output))))
    return out


def shared_prefix_tokens(requests: Sequence[RouteRequest], block_size: int) -> int:
    """Prompt tokens in full blocks some earlier request already sent (the best any
    router with unbounded caches could reuse): a yardstick for the table."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for r in requests:
        for end in range(block_size, len(r.token_ids) + 1, block_size):
            key = tuple(r.token_ids[:end])
            if key in seen:
                total += block_size
            else:
                seen.add(key)
    return total
