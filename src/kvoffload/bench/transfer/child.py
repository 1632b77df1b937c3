"""One revision's copy path, measured on command: the child process of ``--against``.

Run as a script (``python -P child.py``: ``-P`` keeps this script's folder off
``sys.path``) with ``PYTHONPATH`` pointing at the
``src`` folder of the revision to measure, so that ``kvoffload.transfer`` is
that revision's. It therefore uses only the transfer API every measured
revision has (``OffloadingWorker.for_cpu_tier``, ``HostPool(buffer=)``,
``host_buffer``, the block-id specs) and imports nothing else of kvoffload.

Protocol: one JSON object a line on stdin, ``{"setup": {...}, "rounds": k}``
(the block geometry, pool and job sizes, pattern and seed, threads), answered
by one line ``{"times": [[store, load, bulk, bulk_load], ...], "bytes": n}``:
seconds of each timed step of each round, the four steps run back to back so
that the ratios compare copies made under the same load. A new setup
replaces the last one (its memory is freed first); ``{"quit": true}`` ends.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch

from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import (
    HostPool,
    KVGeometry,
    KVLayout,
    OffloadingWorker,
    TransferSpec,
    parse_dtype,
)
from kvoffload.transfer.host_memory import host_buffer

#: ``chains``: a request's blocks, allocated together, are this many consecutive GPU ids.
CHAIN_BLOCKS = 16
#: ``chains``: the CPU tier hands a job's slots out in runs of this many consecutive slots.
SLOT_RUN = 64


def block_ids(
    pattern: str, pool: int, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` GPU block ids and CPU slots, pairwise, that a job moves (ids below ``pool``).

    ``sequential``: the first ``n`` on both sides. ``random``: drawn at random on
    both sides, in random order (no side has runs but by chance). ``chains``: what
    an engine after churn gives: the GPU ids are chains of ``CHAIN_BLOCKS``
    consecutive ids (a request's blocks) at random places, half of them descending
    (a request's blocks are freed tail first and come back reversed), and the slots
    are runs of ``SLOT_RUN`` consecutive slots at random places (the CPU tier hands
    a job's slots out ascending, from the runs its evictions freed).
    """
    if pattern == "sequential":
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    if pattern == "random":
        gpu_ids = rng.choice(pool, n, replace=False).astype(np.int64)
        return gpu_ids, rng.choice(pool, n, replace=False).astype(np.int64)
    if pattern != "chains":
        raise ValueError(f"unknown block id pattern {pattern!r}")
    return _runs_of(CHAIN_BLOCKS, pool, n, rng, flip=True), _runs_of(SLOT_RUN, pool, n, rng)


def _runs_of(
    run: int, pool: int, n: int, rng: np.random.Generator, flip: bool = False
) -> np.ndarray:
    """``n`` distinct ids below ``pool`` as runs of ``run`` consecutive ids in random order
    (the last may be shorter; shorter runs where the pool has no room for enough of
    them), each run descending with probability 1/2 if ``flip``."""
    run = max(1, min(run, n))
    while run > 1 and pool // run < -(-n // run):  # a small pool: shorter runs fit
        run //= 2
    places, count = pool // run, -(-n // run)
    starts = rng.choice(places, count, replace=False) * run
    ids = (starts[:, None] + np.arange(run)[None, :]).astype(np.int64)
    if flip:
        backwards = rng.random(count) < 0.5
        ids[backwards] = ids[backwards, ::-1]
    return ids.reshape(-1)[:n]


#: Pause before each timed job: longer than an OpenMP team that just ran spins before it
#: sleeps (libgomp, this 2-core VM: up to ~5 ms). A job started at once shared the cores
#: with the bulk copy's spinning team: 1,000 random 64 KiB blocks, 28.5 ms then, 18.0 ms
#: after 10 ms; the store, which came right after the bulk copies, paid it, the load not.
SETTLE_S = 0.01


def settle() -> None:
    """Let the calling thread's OpenMP team (the bulk copy's) go to sleep before a job."""
    time.sleep(SETTLE_S)


class Rig:
    """Both tiers, one worker and the two jobs of one setup."""

    def __init__(self, c: dict[str, Any]) -> None:
        dtype = parse_dtype(c["dtype"])
        geometry = KVGeometry(c["layers"], c["kv_heads"], c["head_size"], c["block_tokens"], dtype)
        layout = KVLayout(geometry, c["layout"])
        pool, n = c["pool"], c["n"]
        nbytes = pool * layout.bytes_per_block
        self.gpu_flat = host_buffer(nbytes)
        gen = torch.Generator().manual_seed(c["seed"])
        tile = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
        whole = nbytes // tile.numel()
        self.gpu_flat[: whole * tile.numel()].view(whole, -1).copy_(tile.expand(whole, -1))
        self.host_flat = host_buffer(nbytes)
        self.host_flat.zero_()  # commit the pages before anything is timed
        region = self.gpu_flat.view(geometry.dtype).view(layout.region_shape(pool))
        gpu = layout.split_region(region)
        host = HostPool(layout, pool, buffer=self.host_flat)
        self.worker = OffloadingWorker.for_cpu_tier(gpu, layout, host, num_threads=c["threads"])
        gpu_ids, slots = block_ids(c["pattern"], pool, n, np.random.default_rng(c["seed"]))
        spec, gpu_spec, cpu_spec = TransferSpec, GPULoadStoreSpec, CPULoadStoreSpec
        self.store = spec(gpu_spec(gpu_ids), cpu_spec(slots))
        self.load = spec(cpu_spec(slots), gpu_spec(gpu_ids))
        self.total = n * layout.bytes_per_block
        self.job_ids = iter(range(1, 1 << 62))
        before = self.gpu_flat[: self.total].clone()
        self._job(True)  # warm up (first touch, thread start-up) and check the round trip
        self._job(False)
        if not torch.equal(before, self.gpu_flat[: self.total]):
            raise RuntimeError("store + load round trip changed the GPU tier's bytes")

    def _job(self, store: bool) -> None:
        job = next(self.job_ids)
        if store:
            self.worker.submit_store(job, self.store)
        else:
            self.worker.submit_load(job, self.load)
        self.worker.wait([job])
        for result in self.worker.get_finished():
            if not result.success:
                raise RuntimeError(f"transfer job failed: {result.error}")

    def round(self) -> list[float]:
        """Seconds of a store, a load and the two bulk copies. Each bulk copy is the faster
        of two back to back: the first may wait for the torch thread team to wake (after a
        job ran on pool threads it has gone to sleep), which is no part of copying bytes.
        Each job starts ``SETTLE_S`` after the step before it (``settle``)."""
        gpu, host = self.gpu_flat[: self.total], self.host_flat[: self.total]
        steps = (
            (True, lambda: self._job(True)),
            (True, lambda: self._job(False)),
            (False, lambda: host.copy_(gpu)),
            (False, lambda: host.copy_(gpu)),
            (False, lambda: gpu.copy_(host)),
            (False, lambda: gpu.copy_(host)),
        )
        out = []
        for is_job, step in steps:
            if is_job:
                settle()
            start = time.perf_counter()
            step()
            out.append(time.perf_counter() - start)
        return [out[0], out[1], min(out[2:4]), min(out[4:6])]

    def close(self) -> None:
        self.worker.close()


def main() -> None:
    rig: Rig | None = None
    key = None
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        setup = command["setup"]
        if json.dumps(setup, sort_keys=True) != key:
            if rig is not None:
                rig.close()
                rig = None  # free both tiers before the next size allocates its own
            rig = Rig(setup)
            key = json.dumps(setup, sort_keys=True)
        current = rig
        assert current is not None
        times = [current.round() for _ in range(command.get("rounds", 1))]
        print(json.dumps({"times": times, "bytes": current.total}), flush=True)
    if rig is not None:
        rig.close()


if __name__ == "__main__":
    main()
