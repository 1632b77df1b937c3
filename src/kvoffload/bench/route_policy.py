"""Routers for the routing bench: KV-aware (Dynamo's indexer), round robin, random.

A router picks an instance for each request from what it knows: the
request's tokens, each instance's load (requests and prefill tokens the
router sent there that have not finished) and, for the KV-aware one, the
indexer's per-tier overlaps. Every router sees the same ``Load`` and the
same overlaps, so they differ only in their choice.

The KV router's cost of sending a prompt of ``P`` tokens to instance ``i``
(lower is better) follows Dynamo's KV router: the prefill it would compute
plus the prefill already queued there,

    cost_i = (P - credit_i) + load_weight * queued_prefill_i,
    credit_i = w_gpu * gpu_i + w_cpu * (cpu_i - gpu_i) + w_disk * (disk_i - cpu_i),

where ``gpu_i <= cpu_i <= disk_i`` are the indexer's staged overlaps (a load
from CPU or disk is cheaper than a recompute, dearer than a GPU hit, hence the
weights below 1). Ties go to the instance with fewer running requests, then
round robin. The shared Redis tier is the same for every instance, so it
changes no choice and the indexer need not know it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.bench.route_indexer import TierOverlap

ROUTERS = ("kv", "round_robin", "random")


@dataclass
class Load:
    """What the router sent to one instance and has not seen finish."""

    requests: int = 0
    prefill_tokens: int = 0  # estimated tokens still to compute for those requests


@dataclass
class Decision:
    instance: int
    overlaps: dict[int, TierOverlap] = field(default_factory=dict)


@dataclass(frozen=True)
class TierWeights:
    gpu: float = 1.0
    cpu: float = 0.8
    disk: float = 0.6

    def credit(self, o: TierOverlap) -> float:
        return self.gpu * o.gpu + self.cpu * (o.cpu - o.gpu) + self.disk * (o.disk - o.cpu)


class Router:
    name = "base"

    def pick(self, num_tokens: int, overlaps: dict[int, TierOverlap], loads: Sequence[Load]) -> int:
        raise NotImplementedError


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, num_tokens: int, overlaps: dict[int, TierOverlap], loads: Sequence[Load]) -> int:
        i = self._next % len(loads)
        self._next += 1
        return i


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def pick(self, num_tokens: int, overlaps: dict[int, TierOverlap], loads: Sequence[Load]) -> int:
        return self._rng.randrange(len(loads))


class KVRouter(Router):
    """Least cost as in the module docstring; ``overlaps`` are keyed by instance index."""

    name = "kv"

    def __init__(self, weights: TierWeights | None = None, load_weight: float = 1.0) -> None:
        self.weights = weights or TierWeights()
        self.load_weight = load_weight
        self._next = 0

    def cost(self, num_tokens: int, overlap: TierOverlap, load: Load) -> float:
        new = num_tokens - self.weights.credit(overlap)
        return new + self.load_weight * load.prefill_tokens

    def pick(self, num_tokens: int, overlaps: dict[int, TierOverlap], loads: Sequence[Load]) -> int:
        n = len(loads)
        start = self._next % n
        self._next += 1
        order = [(start + k) % n for k in range(n)]  # round robin among equals
        return min(
            order,
            key=lambda i: (
                self.cost(num_tokens, overlaps.get(i, TierOverlap()), loads[i]),
                loads[i].requests,
            ),
        )

    def expected_prefill(self, num_tokens: int, overlap: TierOverlap) -> int:
        """Tokens the chosen instance will compute, by the router's estimate (its GPU hit off)."""
        return max(0, num_tokens - overlap.gpu)


def make_router(name: str, seed: int = 0) -> Router:
    if name == "kv":
        return KVRouter()
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "random":
        return RandomRouter(seed)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
