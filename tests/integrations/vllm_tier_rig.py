"""vLLM's real ``TieringOffloadingSpec`` with kvoffload's tiers, driven as vLLM's scheduler does.

Import only from test modules that called ``need_vllm()`` first.

``TierRig`` builds the spec from an ``OffloadingConfig`` (no model, no GPU),
takes its manager (vLLM's ``TieringOffloadingManager`` over its shared CPU
region, the tiers as secondary tiers) and plays the scheduler: ``store``
runs prepare_store / the GPU->CPU copy / complete_store, ``fetch`` runs the
offloading connector's lookup loop (``_maximal_prefix_lookup``: HIT and
HIT_PENDING count, RETRY keeps scanning, MISS stops; deferred lookups are
retried next step) and then prepare_load / the CPU->GPU copy /
complete_load. The copies are done either here (``rows``, the whole rows) or
by ``Ranks``: worker processes (spawned, TP ranks) that map vLLM's
``SharedOffloadRegion`` for their rank and write / check their shard only.
Time spent in ``lookup`` on the test's (scheduler) thread is tallied.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
import uuid
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tests.integrations import vllm_tier_ranks

WORKER_BLOCK_BYTES = 32 << 10
MODULE = "kvoffload.integrations.vllm"


def disk_tier(disk_dir: Any, disk_bytes: str = "4MiB", **extra: Any) -> dict[str, Any]:
    return {
        "type": "KVOffloadDiskTier",
        "module_path": MODULE,
        "disk_dir": str(disk_dir),
        "disk_bytes": disk_bytes,
        **extra,
    }


def redis_tier(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "KVOffloadRedisTier", "module_path": MODULE, "redis_url": url, **extra}


def parallel_config(
    world_size: int, data_parallel: tuple[int, int] = (0, 1), agnostic: bool = False
) -> OffloadingParallelConfig:
    """Rank 0 of a TP=``world_size`` engine (no PP, PCP or DCP); ``data_parallel`` as below."""
    return OffloadingParallelConfig(
        rank=0,
        world_size=world_size,
        tp_size=world_size,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=data_parallel[0],
        data_parallel_size=data_parallel[1],
        data_parallel_rank_local=None,
        is_parallelism_agnostic=agnostic,
    )


def offloading_config(
    tiers: list[dict[str, Any]],
    *,
    world_size: int = 2,
    cpu_chunks: int = 8,
    worker_block_bytes: int = WORKER_BLOCK_BYTES,
    events: bool = True,
    agnostic: bool = False,
    model: str = "tiny/llama",
    engine_id: str | None = None,
    data_parallel: tuple[int, int] = (0, 1),
) -> OffloadingConfig:
    """``data_parallel``: (this replica's index, number of replicas)."""
    row = worker_block_bytes * world_size
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=worker_block_bytes,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": cpu_chunks * row, "secondary_tiers": tiers},
        engine_id=engine_id or f"kvotest-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel_config(world_size, data_parallel, agnostic),
    )


def keys_of(n: int, base: int = 0, tag: bytes = b"") -> list[OffloadKey]:
    return [
        make_offload_key(hashlib.sha256(tag + (base + i).to_bytes(8, "big")).digest(), 0)
        for i in range(n)
    ]


class Ranks:
    """``world_size`` spawned worker processes, one per TP rank (see ``vllm_tier_ranks``)."""

    def __init__(self, world_size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=vllm_tier_ranks.rank_main, args=(rank, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            assert c.recv() == "ready"

    def call(self, *msg: Any) -> list[Any]:
        for c in self.conns:
            c.send(msg)
        out = []
        for c in self.conns:
            reply = c.recv()
            if isinstance(reply, BaseException):
                raise reply
            out.append(reply)
        return out

    def close(self) -> None:
        for c in self.conns:
            with suppress(OSError):
                c.send(("exit",))
        for p in self.procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()


class TierRig:
    """One engine's scheduler side: vLLM's tiering spec and manager over kvoffload's tiers."""

    def __init__(
        self, tiers: list[dict[str, Any]], ranks: Ranks | None = None, **config: Any
    ) -> None:
        self.config = offloading_config(tiers, **config)
        self.spec = TieringOffloadingSpec(self.config)
        self.manager = self.spec.get_manager()
        self.ranks = ranks
        self.tiers = list(self.manager.secondary_tiers)
        view = self.manager.primary_tier.get_kv_memoryview()
        self.row_bytes = view.strides[0]
        self.num_chunks = self.spec.num_chunks
        self.shard_bytes = self.spec.cpu_page_size_per_worker
        self.world_size = self.config.parallel.world_size
        self._flat = view.cast("B")
        self.rows: np.ndarray | None = np.frombuffer(self._flat, dtype=np.uint8).reshape(
            self.num_chunks, self.row_bytes
        )
        self.lookup_seconds = 0.0
        self.lookup_calls = 0
        self.steps = 0
        self.events: list[Any] = []
        self._req = 0
        if ranks is not None:
            ranks.call(
                "map", self.config.engine_id, self.num_chunks, self.row_bytes, self.shard_bytes
            )

    @property
    def lock(self) -> Any:
        from kvoffload.integrations.vllm.compat import manager_lock

        # 0.33's managers have a lock every caller holds; 0.32's have none.
        return manager_lock(self.manager)

    def new_request(self) -> ReqContext:
        self._req += 1
        ctx = ReqContext(f"req-{self._req}")
        with self.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.lock:
            self.manager.on_request_finished(ctx)

    def step(self) -> None:
        with self.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
            self.events.extend(self.manager.take_events())
        self.steps += 1

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step until no tier has work in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            with self.lock:
                busy = self.manager.has_pending_work()
            if not busy:
                return
            assert time.monotonic() < deadline, "tiers did not settle"
            time.sleep(0.005)

    # -- the copies --------------------------------------------------------------------

    def write(self, chunks: Sequence[int], keys: Sequence[OffloadKey]) -> None:
        """The GPU->CPU copy: every rank writes its shard of each chunk."""
        if self.ranks is not None:
            self.ranks.call("write", list(chunks), [bytes(k) for k in keys])
            return
        assert self.rows is not None
        for c, k in zip(chunks, keys):
            for r in range(self.world_size):
                lo = r * self.shard_bytes
                self.rows[c, lo : lo + self.shard_bytes] = vllm_tier_ranks.shard_pattern(
                    bytes(k), r, self.shard_bytes
                )

    def check(self, chunks: Sequence[int], keys: Sequence[OffloadKey]) -> list[list[bool]]:
        """The CPU->GPU copy: per rank, whether each chunk holds that rank's bytes of its key."""
        if self.ranks is not None:
            return self.ranks.call("check", list(chunks), [bytes(k) for k in keys])
        assert self.rows is not None
        out = []
        for r in range(self.world_size):
            lo = r * self.shard_bytes
            out.append(
                [
                    bool(
                        np.array_equal(
                            self.rows[c, lo : lo + self.shard_bytes],
                            vllm_tier_ranks.shard_pattern(bytes(k), r, self.shard_bytes),
                        )
                    )
                    for c, k in zip(chunks, keys)
                ]
            )
        return out

    # -- the scheduler's calls -------------------------------------------------------------

    def store(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> list[OffloadKey]:
        """Offload ``keys`` as the connector does; returns the keys that were stored."""
        own = ctx is None
        ctx = ctx or self.new_request()
        deadline = time.monotonic() + 30
        while True:
            with self.lock:
                out = self.manager.prepare_store(list(keys), ctx)
            if out is not None:
                break
            # The CPU tier is pinned by cascades in flight: a later step frees it.
            assert time.monotonic() < deadline, "CPU tier stayed full"
            self.step()
            time.sleep(0.005)
        new = list(out.keys_to_store)
        self.write([int(c) for c in out.store_spec.block_ids], new)
        with self.lock:
            self.manager.complete_store(list(keys), ctx, True)
        self.step()
        if own:
            self.finish(ctx)
        return new

    def store_many(self, keys: Sequence[OffloadKey], batch: int = 4) -> None:
        for i in range(0, len(keys), batch):
            self.store(keys[i : i + batch])

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        start = time.perf_counter()
        with self.lock:
            result = self.manager.lookup(key, ctx)
        self.lookup_seconds += time.perf_counter() - start
        self.lookup_calls += 1
        return result

    def prefix_lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> int | None:
        """The connector's ``_maximal_prefix_lookup``: hits, or None when deferred."""
        hits, defer = 0, False
        for key in keys:
            result = self.lookup(key, ctx)
            if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                hits += 1
                defer |= result is LookupResult.HIT_PENDING
            elif result is LookupResult.RETRY:
                defer = True
            else:
                break
        return None if defer else hits

    def fetch(
        self, keys: Sequence[OffloadKey], max_steps: int = 400
    ) -> tuple[int, list[list[bool]]]:
        """Look ``keys`` up until settled, then load the hit prefix; (hits, per-rank checks)."""
        ctx = self.new_request()
        try:
            for _ in range(max_steps):
                hits = self.prefix_lookup(keys, ctx)
                if hits is not None:
                    break
                self.step()
                time.sleep(0.005)
            else:
                raise AssertionError("lookup never settled")
            if hits == 0:
                return 0, [[] for _ in range(self.world_size)]
            with self.lock:
                spec = self.manager.prepare_load(list(keys[:hits]), ctx)
            chunks = [int(c) for c in spec.block_ids]
            checks = self.check(chunks, keys[:hits])
            with self.lock:
                self.manager.complete_load(list(keys[:hits]), ctx)
            return hits, checks
        finally:
            self.step()
            self.finish(ctx)

    def stats(self) -> dict[str, float]:
        with self.lock:
            stats = self.manager.get_stats()
        return {} if stats is None else dict(stats.reduce())

    @property
    def unmapped(self) -> bool:
        """Whether vLLM could unmap its shared region at shutdown (no view of it left)."""
        region = getattr(self.spec, "_scheduler_mmap", None)
        return region is None or region.mmap_obj is None

    def close(self) -> None:
        self.settle()
        if self.ranks is not None:
            self.ranks.call("unmap")
        self.rows = None
        self._flat.release()
        self.manager.shutdown()
