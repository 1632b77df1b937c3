"""Routers for the routing bench: KV-aware (Dynamo's indexer), round robin, random.

Every router sees the same ``Load`` (requests and prefill tokens sent to an instance and
not finished) and the same overlaps, so they differ only in their choice. The KV router's
cost of a prompt of ``P`` tokens on instance ``i`` (lower is better) follows Dynamo's:

    cost_i = (P - credit_i) + load_weight * queued_prefill_i,
    credit_i = w_gpu * gpu_i + w_cpu * (cpu_i - gpu_i) + w_disk * (disk_i - cpu_i),

over the indexer's staged overlaps ``gpu_i <= cpu_i <= disk_i``; ties go to fewer running
requests, then round robin. A request sent right after another with the same prefix
arrives before the indexer knows that prefix, so the router also counts the prefixes it
recently sent each instance (:class:`RecentPrefixes`, as Dynamo's router tracks its
active sequences) as GPU overlap where the indexer has less.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.bench.routing.indexer import TierOverlap

ROUTERS = ("kv", "round_robin", "random")


@dataclass
class Load:
    """What the router sent to one instance and has not seen finish."""

    requests: int = 0
    prefill_tokens: int = 0  # estimated tokens still to compute for those requests


@dataclass(frozen=True)
class TierWeights:
    gpu: float = 1.0
    cpu: float = 0.8
    disk: float = 0.6

    def credit(self, o: TierOverlap) -> float:
        return self.gpu * o.gpu + self.cpu * (o.cpu - o.gpu) + self.disk * (o.disk - o.cpu)


class RecentPrefixes:
    """Per instance, the block-prefix keys of the last ``limit`` prompts sent there."""

    def __init__(self, block_size: int, limit: int = 32) -> None:
        self.block_size = block_size
        self.limit = limit
        self._keys: dict[int, Counter[int]] = {}
        self._order: dict[int, deque[list[int]]] = {}

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """Chained keys of the prompt's full blocks (key k stands for blocks 0..k)."""
        out, prev, bs = [], 0, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            prev = hash((prev, tuple(token_ids[start : start + bs])))
            out.append(prev)
        return out

    def add(self, instance: int, keys: list[int]) -> None:
        counts = self._keys.setdefault(instance, Counter())
        order = self._order.setdefault(instance, deque())
        counts.update(keys)
        order.append(keys)
        if len(order) > self.limit:
            counts.subtract(order.popleft())
            counts += Counter()  # drops keys whose count fell to zero

    def overlap(self, instance: int, keys: list[int]) -> int:
        """Tokens of the leading blocks recently sent to ``instance``."""
        counts = self._keys.get(instance)
        n = 0
        if counts:
            for k in keys:
                if counts[k] <= 0:
                    break
                n += 1
        return n * self.block_size


class Router:
    name = "base"

    def sent(self, instance: int, token_ids: Sequence[int]) -> None:
        """Told after each pick where the request went (routers may remember it)."""

    def pick(
        self,
        num_tokens: int,
        overlaps: dict[int, TierOverlap],
        loads: Sequence[Load],
        token_ids: Sequence[int] | None = None,
    ) -> int:
        """The instance index for a request; a cache-blind router uses ``choose(len(loads))``."""
        return self.choose(len(loads))

    def choose(self, n: int) -> int:
        """An index in ``range(n)`` chosen without looking at caches or loads."""
        raise NotImplementedError


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, n: int) -> int:
        i = self._next % n
        self._next += 1
        return i


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, n: int) -> int:
        return self._rng.randrange(n)


class KVRouter(Router):
    """Least cost as in the module docstring; ``overlaps`` are keyed by instance index."""

    name = "kv"

    def __init__(
        self,
        weights: TierWeights | None = None,
        load_weight: float = 1.0,
        block_size: int | None = None,
        recent: int = 32,
    ) -> None:
        self.weights = weights or TierWeights()
        self.load_weight = load_weight
        self.recent = RecentPrefixes(block_size, recent) if block_size else None
        self._rotation = RoundRobinRouter()  # where the scan for the least cost starts

    def sent(self, instance: int, token_ids: Sequence[int]) -> None:
        if self.recent is not None:
            self.recent.add(instance, self.recent.keys(token_ids))

    def with_recent(
        self, token_ids: Sequence[int], overlaps: dict[int, TierOverlap], n: int
    ) -> dict[int, TierOverlap]:
        """The indexer's overlaps, raised to what this router recently sent each instance."""
        if self.recent is None:
            return overlaps
        keys = self.recent.keys(token_ids)
        out = dict(overlaps)
        for i in range(n):
            mine = self.recent.overlap(i, keys)
            o = out.get(i, TierOverlap())
            if mine > o.gpu:
                top = max(mine, o.disk)
                out[i] = TierOverlap(max(o.longest_matched, top), mine, max(mine, o.cpu), top)
        return out

    def cost(self, num_tokens: int, overlap: TierOverlap, load: Load) -> float:
        new = num_tokens - self.weights.credit(overlap)
        return new + self.load_weight * load.prefill_tokens

    def pick(
        self,
        num_tokens: int,
        overlaps: dict[int, TierOverlap],
        loads: Sequence[Load],
        token_ids: Sequence[int] | None = None,
    ) -> int:
        n = len(loads)
        if token_ids is not None:
            overlaps = self.with_recent(token_ids, overlaps, n)
        start = self._rotation.choose(n)
        order = [(start + k) % n for k in range(n)]  # round robin among equals
        return min(
            order,
            key=lambda i: (
                self.cost(num_tokens, overlaps.get(i, TierOverlap()), loads[i]),
                loads[i].requests,
            ),
        )


def make_router(name: str, seed: int = 0, block_size: int | None = None) -> Router:
    if name == "kv":
        return KVRouter(block_size=block_size)
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "random":
        return RandomRouter(seed)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
