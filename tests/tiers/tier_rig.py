"""A small engine-less rig for tier tests: KV tensors, a host pool, a worker, the tiers.

It plays the connector: stores GPU blocks under keys and loads keys into
GPU blocks through the real worker and handlers, and remembers each key's
bytes so every load can be checked bit for bit.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

from kvoffload.offload import (
    CPUOffloadingManager,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadKey,
    make_offload_key,
)
from kvoffload.tiers.config import TierConfig, TierIdentity
from kvoffload.tiers.stack import LowerTiers, make_tiers
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVGeometry, KVLayout
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.worker import OffloadingWorker

#: ``Rig`` keywords that are the tiers' identity rather than their configuration.
IDENTITY_KEYS = ("hash_fn", "hash_seed", "kv_quant", "tp_rank", "tp_size")

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.float16)


def tkey(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


class Rig:
    def __init__(
        self,
        *,
        cpu_blocks: int = 4,
        gpu_blocks: int = 64,
        disk_dir: Path | None = None,
        disk_blocks: int = 8,
        redis_url: str | None = None,
        kind: str = "layer_first",
        write_mode: str = "write_back",
        geometry: KVGeometry = GEOM,
        model_id: str = "test:rig-model",
        **tier_kw: object,
    ) -> None:
        self.layout = KVLayout(geometry, kind)
        self.gpu = self.layout.allocate(gpu_blocks)
        self.planes = self.layout.block_planes(self.gpu)
        self.pool = HostPool(self.layout, cpu_blocks, pin_memory=False)
        self.cpu = CPUOffloadingManager(cpu_blocks, "lru", enable_events=True)
        self.worker = OffloadingWorker.for_cpu_tier(self.gpu, self.layout, self.pool)
        ident = {k: tier_kw.pop(k) for k in IDENTITY_KEYS if k in tier_kw}
        ident.setdefault("hash_fn", "xxhash64")
        # Synchronous presence unless a test asks otherwise: most tier tests check what a
        # second instance sees at once (test_async_presence covers the asynchronous path).
        tier_kw.setdefault("redis_async_presence", False)
        self.config = TierConfig(
            disk_dir=None if disk_dir is None else str(disk_dir),
            disk_blocks=disk_blocks if disk_dir is not None else None,
            redis_url=redis_url,
            write_mode=write_mode,
            **tier_kw,  # type: ignore[arg-type]
        )
        self.identity = TierIdentity(model_id=model_id, **ident)  # type: ignore[arg-type]
        self.tiers: LowerTiers = make_tiers(
            self.cpu, self.pool, self.gpu, self.layout, self.config, self.identity
        )
        self.tiers.register(self.worker)
        self.m = self.tiers.manager
        self.jobs = itertools.count(1)
        self.truth: dict[OffloadKey, bytes] = {}
        self.rng = np.random.default_rng(0)

    # -- GPU blocks ---------------------------------------------------------------

    def block_bytes(self, b: int) -> bytes:
        return b"".join(p[b].numpy().tobytes() for p in self.planes)

    def fill(self, b: int) -> bytes:
        for p in self.planes:
            p[b].copy_(torch.from_numpy(self.rng.integers(0, 256, p.shape[1], dtype=np.uint8)))
        return self.block_bytes(b)

    def clobber(self) -> None:
        for p in self.planes:
            p.zero_()

    # -- the connector's moves ------------------------------------------------------

    def _run(self, spec: TransferSpec, store: bool) -> bool:
        job = next(self.jobs)
        (self.worker.submit_store if store else self.worker.submit_load)(job, spec)
        assert self.worker.wait([job], timeout=60)
        (res,) = self.worker.get_finished()
        assert res.job_id == job
        return res.success

    def store(self, ids: list[int], gpu_ids: list[int] | None = None) -> bool | None:
        """Compute (random KV in) GPU blocks for keys ``ids`` and store them."""
        gpu_ids = gpu_ids or [i % 32 + 1 for i in ids]
        keys = [tkey(i) for i in ids]
        by_key = {}
        for k, b in zip(keys, gpu_ids):
            self.truth[k] = self.fill(b)
            by_key[k] = b
        out = self.m.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return None
        src = GPULoadStoreSpec([by_key[k] for k in out.keys_to_store])
        ok = self._run(TransferSpec(src, out.store_spec), store=True)
        self.m.complete_store(out.keys_to_store, ok)
        return ok

    def load(self, ids: list[int], first_gpu: int = 40) -> tuple[int, bool]:
        """Look ``ids`` up and load the hit into fresh GPU blocks; checks the bytes."""
        keys = [tkey(i) for i in ids]
        n = self.m.lookup(keys)
        if n == 0:
            return 0, False
        return n, self.finish_load(keys[:n], first_gpu)

    def finish_load(self, keys: list[OffloadKey], first_gpu: int = 40) -> bool:
        """``prepare_load`` the keys already looked up, run the job, settle it; checks bytes."""
        spec = self.m.prepare_load(keys)
        ok = self.run_load(spec, keys, first_gpu)
        self.m.complete_load(keys, success=ok)
        return ok

    def run_load(self, spec: LoadStoreSpec, keys: list[OffloadKey], first_gpu: int = 40) -> bool:
        """Run a prepared load into fresh GPU blocks; checks the bytes of a successful one."""
        dst = list(range(first_gpu, first_gpu + len(keys)))
        ok = self._run(TransferSpec(spec, GPULoadStoreSpec(dst)), store=False)
        if ok:
            for k, b in zip(keys, dst):
                assert self.block_bytes(b) == self.truth[k], f"wrong KV loaded for {k.hex()}"
        return ok

    def close(self) -> None:
        self.worker.close()
        self.tiers.close()
