"""The hybrid replay's workloads: group layouts, long-prompt sessions, the Mooncake trace.

``hybrid_replay`` (``kvoffload bench hybrid``) and ``hybrid_windows_bench``
(``--windows``) replay these; ``hybrid_sched`` reuses ``long_prompts``. Chunk
ids are equal exactly as far as prompts share a prefix (ids are chained).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from kvoffload.bench.policy.mooncake import full_blocks, read_mooncake_trace
from kvoffload.offload.chunk_units import FULL_ATTENTION, GroupLayout

MOONCAKE_TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def layouts(tokens_per_chunk: int) -> dict[str, tuple[GroupLayout, ...]]:
    def sw(window: int) -> GroupLayout:
        return GroupLayout("sliding_window", window, tokens_per_chunk)

    full = GroupLayout(FULL_ATTENTION, None, tokens_per_chunk)
    return {
        "2g-w128": (full, sw(128)),
        "2g-w1024": (full, sw(1024)),
        "4g-w128": (full, sw(128), sw(128), sw(128)),
        "4g-w1024": (full, sw(1024), sw(1024), sw(1024)),
    }


# -- workloads -------------------------------------------------------------------------


def long_prompts(
    num_requests: int, prompt_tokens: int, tokens_per_chunk: int, seed: int = 0
) -> list[list[int]]:
    """Chunk ids of sessions of long prompts: equal ids exactly as far as prefixes are equal.

    Six system prompts (2 K to 8 K tokens, Zipf-popular) open sessions whose
    first prompt has ``prompt_tokens`` tokens; a later turn (60% of requests,
    a recent session) sends the previous prompt plus 512 to 2,048 new tokens.
    """
    rng = random.Random(seed)
    ids: dict[tuple[int, int], int] = {}

    def extend(prompt: list[int], n: int) -> list[int]:
        out = list(prompt)
        for _ in range(n):
            parent = out[-1] if out else -1
            out.append(ids.setdefault((parent, rng.getrandbits(40)), len(ids)))
        return out

    chunks = prompt_tokens // tokens_per_chunk
    systems = [extend([], rng.randint(2048, 8192) // tokens_per_chunk) for _ in range(6)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(systems))]
    sessions: list[list[int]] = []
    prompts: list[list[int]] = []
    for _ in range(num_requests):
        if sessions and rng.random() < 0.6:
            i = rng.randrange(max(0, len(sessions) - 30), len(sessions))
            prompt = extend(sessions[i], rng.randint(512, 2048) // tokens_per_chunk)
            sessions[i] = prompt
        else:
            system = rng.choices(systems, weights)[0]
            prompt = extend(system, chunks - len(system))
            sessions.append(prompt)
        prompts.append(prompt)
    return prompts


def mooncake_prompts(path: Path, limit: int | None = None) -> list[list[int]]:
    """The full 512-token blocks of each request of a Mooncake trace (one chunk per block)."""
    requests = sorted(read_mooncake_trace(path), key=lambda r: r.timestamp)
    if limit is not None:
        requests = requests[:limit]
    return [full_blocks(r, 512) for r in requests]


def _workloads(
    args: argparse.Namespace,
) -> list[tuple[str, tuple[GroupLayout, ...], list[list[int]]]]:
    t = args.tokens_per_chunk
    known = layouts(t)
    chosen = [s for s in args.layouts.split(",") if s]
    for s in chosen:
        if s not in known:
            raise SystemExit(f"unknown layout {s!r}; known: {', '.join(known)}")
    prompts = long_prompts(args.requests, args.prompt_tokens, t, args.seed)
    work = [(f"long16k/{s}", known[s], prompts) for s in chosen]
    if args.mooncake and str(args.mooncake) not in ("", "."):
        if not args.mooncake.exists():
            raise SystemExit(f"no Mooncake trace at {args.mooncake}")
        layout = (GroupLayout(tokens_per_chunk=512), GroupLayout("sliding_window", 1024, 512))
        work.append(
            ("mooncake/2g-w1024", layout, mooncake_prompts(args.mooncake, args.mooncake_requests))
        )
    return work
