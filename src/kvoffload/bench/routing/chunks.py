"""What a router may count of an instance whose offloaded chunks are several GPU blocks.

With ``block_size_factor`` (vLLM: ``blocks_per_chunk``) F > 1 an offloaded
tier holds chunks of F GPU blocks, keyed by the chunk's last block hash.
A self-describing store of a chunk names all F block hashes and tokens
(kvoffload announces each chunk in an event of its own), so an indexer that
counts per GPU block (Dynamo's) credits a prompt with the leading blocks of
a chunk it does not cover whole: a prompt that ends or parts inside the
chunk. The engine cannot load those: it finds a chunk only by its last
block's hash. And kvoffload's reference engine loads a tier's chunks only
from a chunk boundary, so a GPU hit that ends inside a chunk (its tail
blocks evicted from the GPU) ends the hit there, whatever the tiers hold
after it; vLLM instead loads that chunk's missing tail (``tail_loads``).

``loadable_overlap`` applies the rule (docs/routing.md, "Chunks of several GPU
blocks") to an indexer's staged answer: each offloaded stage counts only up
to the last chunk boundary it reaches, and continues the faster stage only
where the engine can start a load. The GPU stage is exact as it is.
"""

from __future__ import annotations

from kvoffload.bench.routing.indexer import TierOverlap


def loadable_overlap(
    overlap: TierOverlap, chunk_tokens: int, tail_loads: bool = False
) -> TierOverlap:
    """``overlap`` cut to what the engine can load with chunks of ``chunk_tokens`` tokens.

    ``tail_loads``: the engine loads the rest of a chunk after a GPU hit that ends inside
    it (vLLM); False for kvoffload's reference engine. Invariant: ``gpu`` is unchanged
    and ``gpu <= cpu <= disk`` still holds; each stage never grows.
    """
    gpu = overlap.gpu
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if gpu % chunk_tokens and not tail_loads:
        return TierOverlap(longest_matched=gpu, gpu=gpu, cpu=gpu, disk=gpu)
    cpu = max(gpu, overlap.cpu // chunk_tokens * chunk_tokens)
    disk = max(cpu, overlap.disk // chunk_tokens * chunk_tokens)
    return TierOverlap(longest_matched=disk, gpu=gpu, cpu=cpu, disk=disk)
