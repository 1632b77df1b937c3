"""``kvoffload bench offload``: the CPU tier's cache policies on a multi-turn chat trace.

The seeded trace of ``kvoffload.bench.workload`` (shared system prompts,
Zipf-popular conversations that grow each turn) is hashed into chained block
keys once, then replayed through a ``CPUOffloadingManager`` per policy and
capacity, as the connector drives it with nothing else in the way (no GPU
tier): per request ``lookup`` of the prompt's blocks, ``prepare_load`` /
``complete_load`` of the hit prefix, and ``prepare_store`` /
``complete_store`` of the rest of the prompt and the reply's blocks (what an
eager offloader stores), touching the blocks that were already there.

Figures per policy and capacity: block-ops/s (keys handled by manager calls
per second of replay; a lookup counts the keys it examined), block hit rate
(prefix-hit prompt blocks over prompt blocks), and beside them LRU's and
Belady's. Belady is the offline
optimum MIN with bypass on the same block access sequence and capacity; it
counts any resident block as a hit, so it bounds every policy's prefix hit
rate from above.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvoffload.bench.workload import TraceHasher, WorkloadConfig, generate_trace
from kvoffload.offload import CPUOffloadingManager, OffloadKey, make_offload_key, policy_names
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY

# One request of the replay: (prompt keys, prompt + reply keys); the first is a prefix.
TraceKeys = tuple[list[OffloadKey], list[OffloadKey]]


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    requests: int
    prompt_blocks: int
    hit_blocks: int
    block_ops: int
    seconds: float
    stores_refused: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.block_ops / self.seconds if self.seconds > 0 else 0.0


def build_trace(config: WorkloadConfig, block_size: int) -> list[TraceKeys]:
    """The workload's requests as offload keys (group 0)."""
    hasher = TraceHasher(block_size)
    out: list[TraceKeys] = []
    for req in generate_trace(config):
        prompt, full = hasher.hashes(req)
        keys = [make_offload_key(h) for h in full]
        out.append((keys[: len(prompt)], keys))
    return out


def replay(trace: Sequence[TraceKeys], policy: str, capacity: int) -> ReplayResult:
    """Drive a fresh manager through ``trace``; see the module docstring."""
    m = CPUOffloadingManager(capacity, cache_policy=policy)
    lookup, prepare_load, complete_load = m.lookup, m.prepare_load, m.complete_load
    prepare_store, complete_store, touch = m.prepare_store, m.complete_store, m.touch
    hits = ops = prompt_blocks = refused = 0
    start = time.perf_counter()
    for prompt, full in trace:
        n = len(prompt)
        prompt_blocks += n
        hit = lookup(prompt)
        ops += min(hit + 1, n)
        if hit:
            loaded = prompt[:hit]
            prepare_load(loaded)
            complete_load(loaded)
            hits += hit
            ops += 2 * hit
        rest = full[hit:]
        if not rest:
            continue
        out = prepare_store(rest)
        ops += len(rest)
        if out is None:
            refused += len(rest)
            continue
        stored = out.keys_to_store
        if len(stored) < len(rest):
            touch(rest)  # the connector touches the blocks that were already there
            ops += len(rest)
        if stored:
            complete_store(stored)
            ops += len(stored)
    seconds = time.perf_counter() - start
    return ReplayResult(policy, capacity, len(trace), prompt_blocks, hits, ops, seconds, refused)


def belady_hit_rate(trace: Sequence[TraceKeys], capacity: int) -> float:
    """Hit rate of MIN with bypass over the trace's block accesses (prompt blocks counted).

    Each request reads its prompt + reply blocks in order; a miss is admitted
    only if its next use comes before that of the resident block used
    farthest in the future (which is then evicted).
    """
    ids: dict[OffloadKey, int] = {}
    seq: list[int] = []
    counted: list[bool] = []
    for prompt, full in trace:
        n = len(prompt)
        for i, key in enumerate(full):
            seq.append(ids.setdefault(key, len(ids)))
            counted.append(i < n)
    never = len(seq)
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for t in range(len(seq) - 1, -1, -1):
        k = seq[t]
        next_use[t] = last.get(k, never)
        last[k] = t
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped lazily
    hits = total = 0
    for t, k in enumerate(seq):
        nu = next_use[t]
        if counted[t]:
            total += 1
        if k in resident:
            if counted[t]:
                hits += 1
        elif len(resident) >= capacity:
            while True:
                neg, v = heap[0]
                if resident.get(v) == -neg:
                    break
                heapq.heappop(heap)
            if -neg <= nu:
                continue  # bypass: the newcomer is needed last
            heapq.heappop(heap)
            del resident[v]
        if nu == never:
            resident.pop(k, None)  # never used again: free its room now
            continue
        resident[k] = nu
        heapq.heappush(heap, (-nu, k))
    return hits / total if total else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    wl = WorkloadConfig()
    parser.add_argument("--requests", type=int, default=wl.num_requests, help="turns in the trace")
    parser.add_argument(
        "--conversations", type=int, default=wl.num_conversations, help="conversation slots"
    )
    parser.add_argument("--system-prompts", type=int, default=wl.num_system_prompts)
    parser.add_argument("--zipf", type=float, default=wl.zipf_s, help="popularity skew s")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument(
        "--capacities",
        type=str,
        default="2048,8192",
        help="comma-separated CPU tier sizes in blocks (default 2048,8192)",
    )
    parser.add_argument(
        "--policies", type=str, default="all", help=f"comma-separated, or all ({policy_names()})"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    return items


def bench(
    config: WorkloadConfig,
    block_size: int,
    capacities: Sequence[int],
    policies: Sequence[str],
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Replay every policy at every capacity; the report as one JSON-able dict."""
    if block_size < 1:
        raise ValueError(f"--block-size must be positive, got {block_size}")
    if any(c < 1 for c in capacities):
        raise ValueError(f"capacities must be positive, got {list(capacities)}")
    known = policy_names()
    for p in policies:
        if p not in known:
            raise ValueError(f"unknown cache policy {p!r}; known: {', '.join(known)}")
    trace = build_trace(config, block_size)
    unique = len({k for _, full in trace for k in full})
    rows: list[dict[str, object]] = []
    by_capacity: dict[str, dict[str, object]] = {}
    for cap in capacities:
        if progress:
            progress(f"belady @ {cap}")
        belady = belady_hit_rate(trace, cap)
        results = {}
        for p in policies:
            if progress:
                progress(f"{p} @ {cap}")
            results[p] = replay(trace, p, cap)
        lru = results["lru"].hit_rate if "lru" in results else None
        best = max(results.values(), key=lambda r: r.hit_rate)
        for r in results.values():
            row = asdict(r)
            row.update(
                hit_rate=r.hit_rate,
                ops_per_s=r.ops_per_s,
                belady_hit_rate=belady,
                vs_lru=(r.hit_rate / lru) if lru else None,
                vs_lru_points=(100 * (r.hit_rate - lru)) if lru is not None else None,
                of_belady=(r.hit_rate / belady) if belady else None,
            )
            rows.append(row)
        by_capacity[str(cap)] = {
            "belady_hit_rate": belady,
            "lru_hit_rate": lru,
            "best_policy": best.policy,
            "best_hit_rate": best.hit_rate,
        }
    return {
        "workload": asdict(config),
        "block_size": block_size,
        "requests": len(trace),
        "prompt_blocks": sum(len(p) for p, _ in trace),
        "unique_blocks": unique,
        "default_policy": DEFAULT_CACHE_POLICY,
        "capacities": by_capacity,
        "results": rows,
    }


def run(args: argparse.Namespace) -> int:
    capacities = [int(c) for c in _parse_list(args.capacities, "capacities")]
    policies = policy_names() if args.policies == "all" else _parse_list(args.policies, "policies")
    config = WorkloadConfig(
        num_requests=args.requests,
        num_conversations=args.conversations,
        num_system_prompts=args.system_prompts,
        zipf_s=args.zipf,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(bench(config, args.block_size, capacities, policies)))
        return 0

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    steps = len(capacities) * (len(policies) + 1)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=steps + 1)

        def progress(what: str) -> None:
            bar.update(task, advance=1, description=what)

        report = bench(config, args.block_size, capacities, policies, progress)
    table = Table(
        title=(
            f"offload policies: {report['requests']:,} requests, "
            f"{report['prompt_blocks']:,} prompt blocks ({report['unique_blocks']:,} unique), "
            f"block size {args.block_size}, seed {args.seed}"
        )
    )
    for col in ("blocks", "policy", "Mops/s", "hit rate", "vs LRU (pt)", "of MIN", "MIN"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for row in report["results"]:  # type: ignore[union-attr]
        vs = row["vs_lru_points"]
        of = row["of_belady"]
        table.add_row(
            f"{row['capacity']:,}",
            row["policy"] + ("*" if row["policy"] == DEFAULT_CACHE_POLICY else ""),
            f"{row['ops_per_s'] / 1e6:.2f}M",
            f"{row['hit_rate']:.2%}",
            f"{vs:+.2f}" if vs is not None else "-",
            f"{of:.1%}" if of is not None else "-",
            f"{row['belady_hit_rate']:.2%}",
        )
    console.print(table)
    console.print(
        "Mops/s: million block operations per second through the manager; MIN: Belady's "
        f"offline optimum (upper bound); * the default policy ({DEFAULT_CACHE_POLICY})"
    )
    for cap, summary in report["capacities"].items():  # type: ignore[union-attr]
        lru = summary["lru_hit_rate"]
        lru_text = f"{lru:.2%}" if lru is not None else "n/a"
        console.print(
            f"capacity {int(cap):,}: best {summary['best_policy']} "
            f"{summary['best_hit_rate']:.2%}, LRU {lru_text}, "
            f"Belady {summary['belady_hit_rate']:.2%}"
        )
    return 0
