"""The suite's hybrid family: KV cache groups (full attention + sliding windows) on a CPU tier.

``kvoffload bench offload --suite`` judges policies on single-group traces;
a hybrid model's tier holds one key per chunk per group, kept and dropped
as chunk units (``kvoffload.offload.chunk_units``), and hits through vLLM
0.33's per-group logic. This family replays ``kvoffload bench hybrid``'s
long-conversation workload (16 K-token prompts, 64-token chunks) on its four
layouts (one full-attention group plus one or three sliding-window groups of
128 or 1,024 tokens) at tiers of 5 / 10 / 20% of the distinct keys, every
candidate with chunk units, beside vLLM's own ``lru`` and ``arc`` managers
with vLLM's per-group logic at the same slots (``hybrid_replay``). The
points join the suite as family ``hybrid``, so the leave-one-family-out
choice sees them. No queue hints here (the replay has no arrival times), and
no Belady (a chunk's worth depends on every group's keys: ``belady`` is NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.bench.policy import hybrid_replay
from kvoffload.bench.policy.hybrid_workloads import layouts, long_prompts
from kvoffload.bench.policy.suite import Point, PolicySpec, Variant, _applied, resolve_policy
from kvoffload.offload.chunk_units import GroupLayout
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY

FAMILY = "hybrid"
LAYOUTS = ("2g-w128", "2g-w1024", "4g-w128", "4g-w1024")
CAPACITIES = (0.05, 0.10, 0.20)
TOKENS_PER_CHUNK = 64
PROMPT_TOKENS = 16384
VLLM_ROWS = ("vllm:lru", "vllm:arc")
#: Suite size -> (requests per workload, first-turn prompt tokens, seeds): the bench's own
#: workload, more seeds in full ("tiny": for tests).
SIZES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "quick": (200, PROMPT_TOKENS, (0,)),
    "full": (200, PROMPT_TOKENS, (0, 1, 2)),
    "tiny": (24, 2048, (0, 1)),
}


def steps(size: str, candidates: int) -> int:
    """Progress steps of ``run_hybrid``: per point vLLM's rows, then one per candidate."""
    return len(LAYOUTS) * len(CAPACITIES) * len(SIZES[size][2]) * (1 + candidates)


#: vLLM's rows at one point: (slots, prompts, layout) -> hit rate by row name.
VllmRows = Callable[[int, list[list[int]], tuple[GroupLayout, ...]], dict[str, float]]


def vllm_hit_rates(
    slots: int, prompts: list[list[int]], layout: tuple[GroupLayout, ...]
) -> dict[str, float]:
    """vLLM 0.33's own managers (``VLLM_ROWS``) through its per-group logic."""
    return {
        row: hybrid_replay.replay(
            hybrid_replay._Vllm(slots, row.removeprefix("vllm:")), row, prompts, layout
        ).hit_rate
        for row in VLLM_ROWS
    }


def run_hybrid(
    policies: Sequence[str],
    variants: Sequence[Variant] = (),
    size: str = "quick",
    progress: Callable[[str], None] | None = None,
    vllm_rows: VllmRows | None = None,
) -> list[Point]:
    """Every candidate (with chunk units) and vLLM's rows at every hybrid point."""
    requests, prompt_tokens, seeds = SIZES[size]
    rows_of = vllm_rows if vllm_rows is not None else vllm_hit_rates
    candidates: list[tuple[str, PolicySpec, Variant | None]] = [
        (p, resolve_policy(p), None) for p in policies
    ]
    candidates += [(v.name, DEFAULT_CACHE_POLICY, v) for v in variants]
    shapes = layouts(TOKENS_PER_CHUNK)
    points = []
    for seed in seeds:
        prompts = long_prompts(requests, prompt_tokens, TOKENS_PER_CHUNK, seed)
        chunks = len({c for p in prompts for c in p})
        for name in LAYOUTS:
            layout = shapes[name]
            trace = f"{FAMILY}/{name}" + (f"/{seed}" if len(seeds) > 1 else "")
            for frac in CAPACITIES:
                slots = max(1, round(frac * chunks * len(layout)))
                label = f"{frac:.0%}"
                if progress:
                    progress(f"{trace} @ {label}: vLLM")
                pt = Point(
                    FAMILY, trace, label, slots, float("nan"), rows_of(slots, prompts, layout)
                )
                for cand, policy, variant in candidates:
                    if progress:
                        progress(f"{trace} @ {label}: {cand}")
                    with _applied(variant):
                        side = hybrid_replay._Ours(slots, layout, policy)
                        pt.hit[cand] = hybrid_replay.replay(side, cand, prompts, layout).hit_rate
                points.append(pt)
    return points
