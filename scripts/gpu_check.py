"""GPU check for kvoffload's vLLM worker: correctness on CUDA and GPU<->pinned-CPU bandwidth.

Runs on a machine with a CUDA device and no vLLM and no network (the lent
H200). ``scripts/gpu_check.sh`` prepares and runs it; see there.

1. ``worker``: kvoffload's vLLM worker (``KVOffloadWorker``, the class vLLM
   drives through ``KVOffloadSpec.get_worker``) on CUDA KV tensors laid out
   as vLLM 0.33 hands them over (int8 block planes), with a pinned host pool:
   store random blocks, wipe them on the GPU, load them back into other GPU
   blocks, compare every byte. Needs ``vllm.v1.kv_offload.base`` importable
   (the shell script carries those few files of the installed vLLM); skipped
   otherwise.
2. ``bandwidth``: per block size (tokens per block) of a Llama-3-8B-like KV
   geometry (32 layers, 8 KV heads, head 128, bf16), store and load jobs of
   ``--blocks`` scattered blocks through kvoffload's CUDA-stream handler
   against one bulk ``cudaMemcpy`` of the same bytes between one contiguous
   device buffer and one pinned host buffer: GB/s and ratio.

Writes ``gpu_check.json`` and prints a table. Exit status 0 when every check
that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvoffload.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import HostPool, KVGeometry, KVLayout, OffloadingWorker

GiB = 1 << 30


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _sync_time(fn: Any) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def check_worker(num_blocks: int, num_layers: int, page_bytes: int) -> dict[str, Any]:
    """KVOffloadWorker round trip on CUDA block planes; bytes compared on the host."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec as VllmGPUSpec

    from kvoffload.integrations.vllm.scheduler.manager import KVOffloadJobSpec
    from kvoffload.integrations.vllm.worker.worker import KVOffloadWorker, plane_layout

    # vLLM 0.33's LBHNC cache with layers interleaved per block: one packed plane.
    buf = torch.zeros(num_blocks, num_layers * page_bytes, dtype=torch.int8, device=DEVICE)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(buf, num_layers * page_bytes)],
        group_data_refs=[[CanonicalKVCacheRef(0, num_layers * page_bytes)]],
    )
    layout, views, _ = plane_layout(caches)
    slots = num_blocks // 2
    pool = HostPool(layout, slots, 1, pin_memory=True)
    worker = KVOffloadWorker(layout, views, pool)
    n = min(64, slots, num_blocks // 4)
    rng = np.random.default_rng(0)
    src_blocks = rng.choice(np.arange(1, num_blocks), size=n, replace=False)
    dst_blocks = rng.choice(np.setdiff1d(np.arange(1, num_blocks), src_blocks), n, replace=False)
    cpu_slots = rng.choice(slots, size=n, replace=False)
    buf[torch.from_numpy(src_blocks).to(DEVICE)] = torch.randint(
        -128, 128, (n, buf.shape[1]), dtype=torch.int8, device=DEVICE
    )
    expect = buf[torch.from_numpy(src_blocks).to(DEVICE)].cpu()

    def gpu_spec(ids: np.ndarray) -> VllmGPUSpec:
        return VllmGPUSpec(ids.tolist(), group_sizes=[len(ids)], block_indices=[0])

    cpu = KVOffloadJobSpec(CPULoadStoreSpec(cpu_slots), op_id=1)
    worker.submit_store(1, gpu_spec(src_blocks), cpu)
    worker.wait({1})
    buf.zero_()
    worker.submit_load(2, cpu, gpu_spec(dst_blocks))
    worker.wait({2})
    results = {r.job_id: r for r in worker.get_finished()}
    got = buf[torch.from_numpy(dst_blocks).to(DEVICE)].cpu()
    ok = all(r.success for r in results.values()) and torch.equal(got, expect)
    worker.shutdown()
    return {
        "ok": bool(ok),
        "blocks": int(n),
        "bytes_verified": int(n * buf.shape[1]) if ok else 0,
        "host_pool_pinned": bool(pool.pinned),
        "results": {j: r.success for j, r in results.items()},
    }


def bandwidth(tokens_per_block: int, num_blocks: int, job_blocks: int, reps: int) -> dict[str, Any]:
    """Scattered store/load jobs through kvoffload vs one bulk copy of the same bytes."""
    geometry = KVGeometry(32, 8, 128, tokens_per_block, torch.bfloat16)
    layout = KVLayout(geometry, "kv_split")
    gpu = layout.allocate(num_blocks, device=DEVICE)
    pool = HostPool(layout, job_blocks, 1, pin_memory=True)
    worker = OffloadingWorker.for_cpu_tier(gpu, layout, pool)
    rng = np.random.default_rng(tokens_per_block)
    nbytes = job_blocks * layout.bytes_per_block
    slots = np.arange(job_blocks)

    def run(kind: str) -> float:
        times = []
        for r in range(reps):
            ids = rng.choice(num_blocks, size=job_blocks, replace=False)
            spec = (
                (GPULoadStoreSpec(ids), CPULoadStoreSpec(slots))
                if kind == "store"
                else (CPULoadStoreSpec(slots), GPULoadStoreSpec(ids))
            )
            job = r + (0 if kind == "store" else 1_000_000)

            def one(job: int = job, spec: Any = spec) -> None:
                (worker.submit_store if kind == "store" else worker.submit_load)(job, spec)
                worker.wait([job])

            times.append(_sync_time(one))
        failed = [x for x in worker.get_finished() if not x.success]
        if failed:
            raise RuntimeError(f"{kind} job failed: {failed[0].error}")
        return min(times)

    run("store")  # warm-up
    store_s, load_s = run("store"), run("load")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    d2h = min(_sync_time(lambda: host.copy_(dev, non_blocking=True)) for _ in range(reps))
    h2d = min(_sync_time(lambda: dev.copy_(host, non_blocking=True)) for _ in range(reps))
    worker.close()
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    return {
        "tokens_per_block": tokens_per_block,
        "block_bytes": layout.bytes_per_block,
        "job_blocks": job_blocks,
        "job_bytes": nbytes,
        "store_GBps": gbs(store_s),
        "bulk_d2h_GBps": gbs(d2h),
        "store_vs_bulk": d2h / store_s,
        "load_GBps": gbs(load_s),
        "bulk_h2d_GBps": gbs(h2d),
        "load_vs_bulk": h2d / load_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--tokens-per-block", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--job-gib", type=float, default=1.0, help="bytes per job, GiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="run every step small on CPU tensors (no GPU)"
    )
    args = parser.parse_args(argv)
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if DEVICE == "cuda" and not torch.cuda.is_available():
        report["error"] = "no CUDA device"
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report))
        return 1
    ok = True
    try:
        small = DEVICE == "cpu"
        report["worker"] = check_worker(
            num_blocks=64 if small else 512, num_layers=4 if small else 32, page_bytes=65536
        )
        ok &= report["worker"]["ok"]
    except ImportError as exc:
        report["worker"] = {"skipped": f"vllm.v1.kv_offload.base not importable: {exc}"}
    except Exception:
        report["worker"] = {"ok": False, "error": traceback.format_exc()}
        ok = False
    print("worker:", json.dumps(report["worker"]))
    rows = []
    for tpb in args.tokens_per_block:
        block_bytes = 2 * 32 * 8 * 128 * 2 * tpb
        job_blocks = max(1, int(args.job_gib * GiB) // block_bytes)
        num_blocks = max(4 * job_blocks, 64)
        try:
            rows.append(bandwidth(tpb, num_blocks, job_blocks, args.reps))
        except Exception:
            rows.append({"tokens_per_block": tpb, "error": traceback.format_exc()})
            ok = False
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    report["bandwidth"] = rows
    print(
        f"{'tok/blk':>7} {'blk KiB':>8} {'store':>7} {'bulk':>7} {'ratio':>6} "
        f"{'load':>7} {'bulk':>7} {'ratio':>6}   (GB/s)"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['tokens_per_block']:>7} error: {r['error'].splitlines()[-1]}")
            continue
        print(
            f"{r['tokens_per_block']:>7} {r['block_bytes'] // 1024:>8} {r['store_GBps']:>7.1f} "
            f"{r['bulk_d2h_GBps']:>7.1f} {r['store_vs_bulk']:>6.2f} {r['load_GBps']:>7.1f} "
            f"{r['bulk_h2d_GBps']:>7.1f} {r['load_vs_bulk']:>6.2f}"
        )
    report["ok"] = bool(ok)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
