"""vLLM's own CPU offloading manager, driven as ``kvoffload bench offload`` drives ours.

vLLM is optional: ``unavailable()`` says why it cannot be imported (None when
it can), and nothing here imports it before it is needed. Per request the
replay does what vLLM's offloading connector does with one request's blocks:
``on_new_request``, one ``lookup`` per key until the first that is not a
ready hit, ``prepare_load`` / ``complete_load`` of the hits, ``prepare_store``
of the rest and ``complete_store`` of the keys it took, then
``on_request_finished`` (where vLLM's policies apply a request's recency).
Keys carry their token positions (512-token blocks) as the connector records
them. Block operations are counted exactly as for kvoffload's managers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cache

from kvoffload.offload import OffloadKey

#: Row name -> (vLLM cache policy, store_threshold).
ROWS: dict[str, tuple[str, int]] = {
    "vllm:lru": ("lru", 1),
    "vllm:arc": ("arc", 1),
    "vllm:lru+store_threshold=2": ("lru", 2),
}
TOKENS_PER_BLOCK = 512


@cache
def unavailable() -> str | None:
    """None if vLLM's offloading manager imports, else the reason."""
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception as exc:  # any failure to import means: not available
        return f"vLLM unavailable ({type(exc).__name__}: {exc})"
    return None


def replay(
    trace: Sequence[Sequence[OffloadKey]], policy: str, capacity: int, store_threshold: int = 1
) -> tuple[int, int, float, int]:
    """(hit blocks, block ops, seconds, refused blocks) of vLLM's manager on ``trace``."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(capacity, cache_policy=policy, store_threshold=store_threshold)
    hit_result = LookupResult.HIT
    hits = ops = refused = 0
    start = time.perf_counter()
    for i, keys in enumerate(trace):
        ctx = ReqContext(req_id=str(i))
        for j, key in enumerate(keys):
            ctx.set_offload_key_position(key, (j + 1) * TOKENS_PER_BLOCK)
        m.on_new_request(ctx)
        n = len(keys)
        hit = 0
        for key in keys:
            if m.lookup(key, ctx) is not hit_result:
                break
            hit += 1
        ops += min(hit + 1, n)
        if hit:
            loaded = list(keys[:hit])
            m.prepare_load(loaded, ctx)
            m.complete_load(loaded, ctx)
            hits += hit
            ops += 2 * hit
        rest = list(keys[hit:])
        if rest:
            out = m.prepare_store(rest, ctx)
            ops += len(rest)
            if out is None:
                refused += len(rest)
            elif out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx)
                ops += len(out.keys_to_store)
        m.on_request_finished(ctx)
    return hits, ops, time.perf_counter() - start, refused
