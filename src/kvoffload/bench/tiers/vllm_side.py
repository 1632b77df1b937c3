"""vLLM's tiering manager driven as vLLM's scheduler drives it: the engine of ``bench tiers-vllm``.

An ``Engine`` is vLLM's ``TieringOffloadingManager`` (built by vLLM's
``TieringOffloadingSpec``) over one secondary tier; this process plays the
offloading connector's calls and the GPU<->CPU copies (memcpy into the shared CPU
rows). ``Clock`` counts the seconds spent in the manager's calls on this thread.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

MODULE = "kvoffload.integrations.vllm"


def _config(entry: dict[str, Any], block_bytes: int, cpu_chunks: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_chunks * block_bytes, "secondary_tiers": [entry]},
        engine_id=f"kvobench-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name="bench/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


@dataclass
class Clock:
    """Seconds spent in the manager's calls on this (the scheduler) thread."""

    seconds: float = 0.0
    lookup_seconds: float = 0.0
    steps: int = 0

    @contextmanager
    def manager_call(self, lookup: bool = False) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - start
            self.seconds += dt
            if lookup:
                self.lookup_seconds += dt


class Engine:
    """One vLLM tiering manager with one secondary tier, driven as vLLM's scheduler does."""

    def __init__(self, entry: dict[str, Any], block_bytes: int, cpu_chunks: int) -> None:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.spec = TieringOffloadingSpec(_config(entry, block_bytes, cpu_chunks))
        self.manager = self.spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.block_bytes = view.strides[0]
        self._flat = view.cast("B")
        self.rows: np.ndarray | None = np.frombuffer(self._flat, dtype=np.uint8).reshape(
            -1, self.block_bytes
        )
        self.clock = Clock()
        self._ctx_id = 0
        self.misses = 0

    @property
    def lock(self) -> Any:
        from kvoffload.integrations.vllm.compat import manager_lock

        # 0.33's managers have a lock every caller holds; 0.32's have none.
        return manager_lock(self.manager)

    def call(self, fn: Callable[..., Any], *args: Any, lookup: bool = False) -> Any:
        with self.clock.manager_call(lookup), self.lock:
            return fn(*args)

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.call(self.manager.on_schedule_end, ScheduleEndContext((), ()))
        self.clock.steps += 1

    def new_request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._ctx_id += 1
        ctx = ReqContext(f"bench-{self._ctx_id}")
        self.call(self.manager.on_new_request, ctx)
        return ctx

    def settle(self) -> None:
        while self.call(self.manager.has_pending_work):
            self.step()
            time.sleep(0.0002)

    def write(self, keys: list[Any], data: np.ndarray, batch: int) -> float:
        """Store ``keys`` (row i gets ``data[i % len(data)]``); seconds until all cascaded."""
        assert self.rows is not None
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            part = keys[i : i + batch]
            ctx = self.new_request()
            while True:
                out = self.call(self.manager.prepare_store, part, ctx)
                if out is not None:
                    break
                # The CPU tier is pinned by cascades in flight.
                self.step()
                time.sleep(0.0002)
            for j, c in enumerate(out.store_spec.block_ids):
                self.rows[int(c)] = data[(i + j) % len(data)]
            self.call(self.manager.complete_store, part, ctx, True)
            self.call(self.manager.on_request_finished, ctx)
            self.step()
        self.settle()
        return time.perf_counter() - start

    def read(self, keys: list[Any], batch: int, in_flight: int) -> float:
        """Look up and load ``keys`` in requests of ``batch``; seconds until all loaded."""
        from vllm.v1.kv_offload.base import LookupResult

        hit_like = (LookupResult.HIT, LookupResult.HIT_PENDING)
        todo = [keys[i : i + batch] for i in range(0, len(keys), batch)]
        active: list[tuple[Any, list[Any]]] = []
        start = time.perf_counter()
        while todo or active:
            while todo and len(active) < in_flight:
                active.append((self.new_request(), todo.pop(0)))
            still = []
            for ctx, part in active:
                hits, defer = 0, False
                for key in part:
                    r = self.call(self.manager.lookup, key, ctx, lookup=True)
                    if r in hit_like:
                        hits += 1
                        defer |= r is LookupResult.HIT_PENDING
                    elif r is LookupResult.RETRY:
                        defer = True
                    else:
                        break
                if defer:
                    still.append((ctx, part))
                    continue
                if hits:
                    self.call(self.manager.prepare_load, part[:hits], ctx)
                    self.call(self.manager.complete_load, part[:hits], ctx)
                self.misses += len(part) - hits
                self.call(self.manager.on_request_finished, ctx)
            active = still
            self.step()
            if active:
                time.sleep(0.0002)
        self.settle()
        return time.perf_counter() - start

    def close(self) -> None:
        self.settle()
        self.rows = None
        self._flat.release()
        self.manager.shutdown()
