"""A TP rank's side of vLLM's shared CPU region, run in a spawned worker process.

``rank_main`` maps vLLM's ``SharedOffloadRegion`` for its rank (as vLLM's
``TieringOffloadingSpec.create_worker`` does) and, on command, writes its
shard of chunks (the GPU->CPU copy) or checks them (the CPU->GPU copy). The
bytes of rank ``r``'s shard of a block are ``shard_pattern(key, r, n)``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def shard_pattern(key: bytes, rank: int, nbytes: int) -> np.ndarray:
    digest = hashlib.shake_128(key + b"rank" + rank.to_bytes(2, "big")).digest(nbytes)
    return np.frombuffer(digest, dtype=np.uint8)


def rank_main(rank: int, conn: Any) -> None:
    import torch
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    region = None
    shard: np.ndarray | None = None
    conn.send("ready")
    while True:
        msg = conn.recv()
        try:
            op = msg[0]
            if op == "exit":
                return
            if op == "map":
                _, engine_id, num_chunks, row_bytes, shard_bytes = msg
                region = SharedOffloadRegion(
                    engine_id=engine_id,
                    num_chunks=num_chunks,
                    rank=rank,
                    kv_bytes_per_chunk=row_bytes,
                    cpu_page_size=shard_bytes,
                )
                tensor = region.create_next_worker_view(shard_bytes)
                assert tensor.dtype == torch.int8
                shard = tensor.numpy().view(np.uint8)
                del tensor
                conn.send(None)
            elif op == "write":
                _, chunks, keys = msg
                assert shard is not None
                for c, k in zip(chunks, keys):
                    shard[c] = shard_pattern(k, rank, shard.shape[1])
                conn.send(None)
            elif op == "check":
                _, chunks, keys = msg
                assert shard is not None
                conn.send(
                    [
                        bool(np.array_equal(shard[c], shard_pattern(k, rank, shard.shape[1])))
                        for c, k in zip(chunks, keys)
                    ]
                )
            elif op == "unmap":
                shard = None
                if region is not None:
                    region.cleanup()
                    region = None
                conn.send(None)
            else:
                conn.send(ValueError(f"unknown op {op!r}"))
        except Exception as exc:  # the test process raises it
            conn.send(exc)
