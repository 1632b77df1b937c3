"""``kvoffload bench transfer``: block store/load bandwidth against one bulk copy.

For each block size, a store job copies ``--blocks`` GPU-tier blocks into CPU
slots through ``OffloadingWorker`` and a load job copies them back; in the
same run one bulk ``torch`` copy of the same total bytes between the same two
memory regions gives the practical limit, and the ratio is printed. On a CUDA
machine the GPU tier lives on the device and the copies cross PCIe
(host<->device); otherwise both tiers are host memory.

Block ids are a random pick from pools 1/8 larger than the job, in random
order on both sides (``--pattern random``): no side is one consecutive run.
``--pattern chains`` is an engine after churn as the CPU tier and vLLM's block
pool hand ids out (``child.block_ids``): GPU ids in request chains of 16, half
of them reversed, CPU slots in runs of 64. ``--pattern sequential`` gives the
easy case.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvoffload.bench.transfer.args import DEFAULT_SIZES, QUICK_SIZES
from kvoffload.bench.transfer.args import add_arguments as add_arguments  # re-exported
from kvoffload.bench.transfer.child import block_ids, settle
from kvoffload.cli import argtypes
from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import (
    LAYOUT_KINDS,
    GpuCpuJobPlanner,
    HostPool,
    KVGeometry,
    KVLayout,
    OffloadingWorker,
    RowPairs,
    TransferSpec,
    format_bytes,
    parse_bytes,
    parse_dtype,
)
from kvoffload.transfer.copy_plan import choose_strategy
from kvoffload.transfer.host_memory import host_buffer, pin_in_place, unpin

# Both tiers must fit in this share of the available memory.
_MEMORY_SHARE = 0.6


@dataclass
class SizeResult:
    block_bytes: int
    store_gbps: float
    load_gbps: float
    bulk_gbps: float
    bulk_load_gbps: float
    store_ratio: float
    load_ratio: float
    layout: str
    blocks: int
    block_size_tokens: int
    device: str
    pattern: str
    store_strategy: str
    load_strategy: str


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _geometry(block_bytes: int, args: argparse.Namespace) -> KVGeometry:
    probe = KVGeometry(args.layers, args.kv_heads, args.head_size, 1, parse_dtype(args.dtype))
    per_token = probe.bytes_per_token
    if block_bytes % per_token:
        raise ValueError(
            f"block size {format_bytes(block_bytes)} is not a whole number of tokens of "
            f"{per_token} bytes ({args.layers} layers x {args.kv_heads} KV heads x "
            f"{args.head_size} x 2 x {probe.element_size} bytes)"
        )
    return KVGeometry(
        args.layers, args.kv_heads, args.head_size, block_bytes // per_token, probe.dtype
    )


def _best_seconds_interleaved(
    fns: list[Callable[[], object]],
    repeats: int,
    sync: Callable[[], None],
    jobs: tuple[int, ...] = (),
) -> list[float]:
    """Best time of each of ``fns``, run round-robin so that noise from other
    processes on the machine hits all of them alike; ``fns[i]`` for ``i`` in
    ``jobs`` starts ``child.SETTLE_S`` after the step before it."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync()
            if i in jobs:
                settle()  # as the child does before a job (child.SETTLE_S says why)
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _fill_pattern(flat: torch.Tensor, seed: int) -> None:
    """Fill ``flat`` (uint8) with a tiled random pattern at copy speed."""
    tile = 1 << 20
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, 256, (tile,), dtype=torch.uint8, generator=gen).to(flat.device)
    whole = flat.numel() // tile
    if whole:
        flat[: whole * tile].view(whole, tile).copy_(pattern.expand(whole, tile))
    rest = flat.numel() - whole * tile
    flat[whole * tile :].copy_(pattern[:rest])


@dataclass
class Buffers:
    """Memory shared by every size and layout of a run: committed once, reused."""

    gpu: torch.Tensor  # flat uint8, on the GPU-tier device
    host: torch.Tensor  # flat uint8 host memory, pinned on CUDA machines

    pinned: bool = False

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device, seed: int) -> Buffers:
        """Both tiers in the same kind of memory as the engine's (``HostPool``'s) own."""
        if device.type == "cuda":
            gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            gpu = host_buffer(nbytes)
        _fill_pattern(gpu, seed)
        host = host_buffer(nbytes)
        host.zero_()  # commit the pages before anything is timed
        pinned = device.type == "cuda" and pin_in_place(host)
        if device.type == "cuda" and not pinned:
            host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        return cls(gpu, host, pinned)

    def release(self) -> None:
        if self.pinned:
            unpin(self.host)
            self.pinned = False


def _pool_sizes(block_bytes: int, args: argparse.Namespace, buffer_bytes: int) -> tuple[int, int]:
    """(pool blocks, job blocks) for one block size within ``buffer_bytes`` per tier."""
    n = args.blocks
    pool = n if args.pattern == "sequential" else n + max(1, n // 8)
    fit = buffer_bytes // block_bytes
    if fit < pool:
        pool = max(2, fit)
        n = pool if args.pattern == "sequential" else max(1, pool * 8 // 9)
    return pool, n


def measure(
    block_bytes: int,
    layout_kind: str,
    args: argparse.Namespace,
    device: torch.device,
    buffers: Buffers,
) -> SizeResult:
    """Store, load and bulk bandwidth for one block size and layout."""
    layout = KVLayout(_geometry(block_bytes, args), layout_kind)
    pool, n = _pool_sizes(block_bytes, args, buffers.gpu.numel())
    rng = np.random.default_rng(args.seed)
    nbytes = pool * layout.bytes_per_block
    flat_gpu = buffers.gpu[:nbytes]
    region = flat_gpu.view(layout.geometry.dtype).view(layout.region_shape(pool))
    gpu = layout.split_region(region)
    host = HostPool(layout, pool, buffer=buffers.host)
    flat_host = buffers.host[:nbytes]
    worker = OffloadingWorker.for_cpu_tier(gpu, layout, host, num_threads=args.threads)
    gpu_ids, slots = block_ids(args.pattern, pool, n, rng)
    store = TransferSpec(GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(slots))
    load = TransferSpec(CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu_ids))
    job_ids = iter(range(1, 1 << 30))

    def run_job(spec: TransferSpec, is_store: bool) -> None:
        job = next(job_ids)
        (worker.submit_store if is_store else worker.submit_load)(job, spec)
        worker.wait([job])
        for res in worker.get_finished():
            if not res.success:
                raise RuntimeError(f"transfer job failed: {res.error}")

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    total = n * layout.bytes_per_block
    try:
        before = flat_gpu.clone() if nbytes <= (64 << 20) else None
        run_job(store, True)  # warm up (first touch, thread start-up) and check
        run_job(load, False)
        if before is not None and not torch.equal(before, flat_gpu):
            raise RuntimeError("store + load round trip changed the GPU tier's bytes")
        host_part, gpu_part = flat_host[:total], flat_gpu[:total]
        # The bulk copies overwrite both tiers with each other's bytes; the
        # timed jobs do not care what the bytes are.
        t_store, t_load, t_bulk, t_bulk_load = _best_seconds_interleaved(
            [
                lambda: run_job(store, True),
                lambda: run_job(load, False),
                lambda: host_part.copy_(gpu_part),
                lambda: gpu_part.copy_(host_part),
            ],
            args.repeats,
            sync,
            jobs=(0, 1),
        )
    finally:
        worker.close()
    planner = GpuCpuJobPlanner(gpu, layout, host)
    store_strategy = choose_strategy(RowPairs.build(gpu_ids, slots), planner.store_groups)
    load_strategy = choose_strategy(RowPairs.build(slots, gpu_ids), planner.load_groups)
    gb = total / 1e9
    store_gbps, load_gbps = gb / t_store, gb / t_load
    bulk_gbps, bulk_load_gbps = gb / t_bulk, gb / t_bulk_load
    return SizeResult(
        block_bytes=block_bytes,
        store_gbps=store_gbps,
        load_gbps=load_gbps,
        bulk_gbps=bulk_gbps,
        bulk_load_gbps=bulk_load_gbps,
        store_ratio=store_gbps / bulk_gbps,
        load_ratio=load_gbps / bulk_load_gbps,
        layout=layout_kind,
        blocks=n,
        block_size_tokens=layout.geometry.block_size,
        device=str(device),
        pattern=args.pattern,
        store_strategy=store_strategy,
        load_strategy=load_strategy,
    )


def _buffer_bytes(sizes: list[int], args: argparse.Namespace, device: torch.device) -> int:
    """Bytes per tier: the largest size's pool, capped by available memory."""
    n = args.blocks
    pool = n if args.pattern == "sequential" else n + max(1, n // 8)
    want = max(sizes) * pool
    avail = _available_memory()
    if avail is not None:
        tiers_in_ram = 2 if device.type == "cpu" else 1
        want = min(want, int(avail * _MEMORY_SHARE) // tiers_in_ram)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        want = min(want, int(free * _MEMORY_SHARE))
    return max(want, 2 * max(sizes))


def _resolve(args: argparse.Namespace) -> tuple[list[int], list[str], torch.device]:
    if args.quick:
        if args.sizes is None:
            args.sizes = QUICK_SIZES
        if args.blocks == 1000:
            args.blocks = 64
        args.repeats = min(args.repeats, 2)
    sizes = args.sizes if isinstance(args.sizes, list) else None
    if sizes is None:
        sizes = [parse_bytes(s) for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    if not sizes:
        raise ValueError("--sizes is empty")
    for name in ("blocks", "repeats", "rounds", "threads", "layers", "kv_heads", "head_size"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    for size in sizes:
        _geometry(size, args)
    # Both tiers hold at least two blocks of the largest size; refuse before allocating.
    argtypes.check_fits_in_memory(
        f"--sizes {format_bytes(max(sizes))} (two tiers of two blocks)", 4 * max(sizes)
    )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    kinds = list(LAYOUT_KINDS) if args.layout == "all" else [args.layout]
    return sizes, kinds, device


def bench(args: argparse.Namespace, progress: Callable[[], None] | None = None) -> dict:
    sizes, kinds, device = _resolve(args)
    buffers = Buffers.allocate(_buffer_bytes(sizes, args, device), device, args.seed)
    results = []
    try:
        for kind in kinds:
            for size in sizes:
                results.append(asdict(measure(size, kind, args, device, buffers)))
                if progress is not None:
                    progress()
    finally:
        buffers.release()
    return {
        "results": results,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "pattern": args.pattern,
    }


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from kvoffload.bench.console import console, progress_bar

    sizes, kinds, device = _resolve(args)
    if args.against:
        if device.type != "cpu":
            raise ValueError("--against measures the host copy path: use --device cpu")
        from kvoffload.bench.transfer.against import run_against

        return run_against(args, sizes, kinds)
    with progress_bar("transfer", len(sizes) * len(kinds)) as advance:
        report = bench(args, progress=advance)
    if args.json:
        print(json.dumps(report))
        return 0
    where = "host<->device over PCIe" if device.type == "cuda" else "host memory to host memory"
    table = Table(
        title=f"block store/load vs one bulk copy (GB/s): {where}, {args.pattern} block ids",
        caption=f"{torch.get_num_threads()} torch threads; strategies are copy_plan's choices",
    )
    for col in ("layout", "block", "blocks", "store", "load", "bulk", "store%", "load%"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    table.add_column("strategy", justify="left")
    for r in report["results"]:
        bulk = f"{r['bulk_gbps']:.1f}"
        if abs(r["bulk_gbps"] - r["bulk_load_gbps"]) > 0.05 * r["bulk_gbps"]:
            bulk += f"/{r['bulk_load_gbps']:.1f}"
        table.add_row(
            r["layout"],
            format_bytes(r["block_bytes"]),
            f"{r['blocks']:,}",
            f"{r['store_gbps']:.1f}",
            f"{r['load_gbps']:.1f}",
            bulk,
            f"{r['store_ratio']:.0%}",
            f"{r['load_ratio']:.0%}",
            r["store_strategy"]
            if r["store_strategy"] == r["load_strategy"]
            else f"{r['store_strategy']}/{r['load_strategy']}",
        )
    console(110).print(table)
    return 0
