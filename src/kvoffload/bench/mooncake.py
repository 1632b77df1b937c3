"""Replay a Mooncake-format trace through the GPU block pool and the CPU tier, no model.

A Mooncake trace is JSON lines with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``: one id per block of the prompt, equal ids
meaning equal prefix blocks (the ids are already chained). Replaying it
through ``BlockPool`` and an ``OffloadingManager`` measures prefix hit rates
at a scale the reference model cannot serve on a CPU.

Requests are replayed in timestamp order; each holds its blocks for
``hold_requests`` later arrivals (a crude stand-in for its decode time) and
is then freed, tail first.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.hashing import BlockHash
from kvoffload.offload import CPUOffloadingManager, make_offload_key
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY


@dataclass(frozen=True)
class MooncakeRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_mooncake_trace(path: str | Path) -> Iterator[MooncakeRequest]:
    """Parse a trace, with the line number in every error."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = MooncakeRequest(
                    timestamp=float(obj["timestamp"]),
                    input_length=int(obj["input_length"]),
                    output_length=int(obj["output_length"]),
                    hash_ids=[int(h) for h in obj["hash_ids"]],
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            if req.input_length < 0 or req.output_length < 0:
                raise ValueError(f"{path}:{lineno}: negative length")
            yield req


@dataclass
class ReplayResult:
    requests: int = 0
    blocks: int = 0
    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0

    @property
    def hit_rate_gpu(self) -> float:
        return self.gpu_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_cpu(self) -> float:
        return self.cpu_hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_rate_gpu": self.hit_rate_gpu,
            "hit_rate_cpu": self.hit_rate_cpu,
            "hit_rate_total": self.hit_rate_gpu + self.hit_rate_cpu,
        }


def _hash(block_id: int) -> BlockHash:
    return BlockHash(block_id.to_bytes(8, "big", signed=True))


def replay_mooncake(
    requests: list[MooncakeRequest],
    num_gpu_blocks: int,
    num_cpu_blocks: int | None,
    cache_policy: str | None = None,
    hold_requests: int = 8,
) -> ReplayResult:
    """Hit rates of ``requests`` with a GPU tier of ``num_gpu_blocks`` and a CPU tier."""
    pool = BlockPool(num_gpu_blocks)
    manager = None
    if num_cpu_blocks:
        manager = CPUOffloadingManager(num_cpu_blocks, cache_policy or DEFAULT_CACHE_POLICY)
    res = ReplayResult()
    held: deque[list[KVCacheBlock]] = deque()
    for req in sorted(requests, key=lambda r: r.timestamp):
        hashes = [_hash(h) for h in req.hash_ids]
        n = len(hashes)
        while held and (len(held) >= hold_requests or pool.get_num_free_blocks() < n):
            pool.free_request_blocks(held.popleft())
        if n > pool.num_blocks - 1:
            hashes, n = hashes[: pool.num_blocks - 1], pool.num_blocks - 1
        hits: list[KVCacheBlock] = []
        for h in hashes:
            b = pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        keys = [make_offload_key(h) for h in hashes[len(hits) :]]
        cpu_hit = 0
        if manager is not None and keys:
            if hits:
                manager.touch([make_offload_key(h) for h in hashes[: len(hits)]])
            cpu_hit = manager.lookup(keys)
            if cpu_hit:
                manager.prepare_load(keys[:cpu_hit])
                manager.complete_load(keys[:cpu_hit])
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(n - len(hits))
        pool.cache_full_blocks(blocks, hashes, len(hits), n, 1)
        if manager is not None and keys[cpu_hit:]:
            out = manager.prepare_store(keys[cpu_hit:])
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store)
        held.append(blocks)
        res.requests += 1
        res.blocks += n
        res.gpu_hit_blocks += len(hits)
        res.cpu_hit_blocks += cpu_hit
    return res
