"""``kvoffload bench blocks``: free block queue churn against a list baseline.

The workload mimics what an engine does to the GPU free queue each step:
allocate a batch of blocks from the front, free finished requests' blocks
(tail first), take prefix-hit blocks out of the middle, and let the lazy
offloader walk the queue from a saved cursor. Both queues run the very same
seeded operation sequence through the same driver; the baseline (a Python
list with ``list.remove``) runs only a prefix of it when it would be too slow.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvoffload.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from kvoffload.cli import argtypes

POP, FREE, HIT, WALK = range(4)
OP_NAMES = ("popleft_n", "append_n", "remove", "iter_blocks_after")


class ListFreeQueue:
    """Naive baseline: a list in eviction order, O(n) remove and popleft."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.items = list(blocks)
        self.members = set(map(id, blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.items)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return id(block) in self.members

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        out, self.items = self.items[:n], self.items[n:]
        self.members.difference_update(map(id, out))
        return out

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            self.items.append(b)
            self.members.add(id(b))

    def remove(self, block: KVCacheBlock) -> None:
        self.items.remove(block)
        self.members.discard(id(block))

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        start = 0 if cursor is None else self.items.index(cursor) + 1
        return iter(self.items[start:])


@dataclass
class ChurnResult:
    name: str
    ops: int = 0
    seconds: float = 0.0
    per_op: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OP_NAMES, 0))

    @property
    def mops(self) -> float:
        return self.ops / self.seconds / 1e6 if self.seconds > 0 else 0.0


def make_workload(num_ops: int, seed: int, max_batch: int = 64) -> list[tuple[int, int]]:
    """A seeded list of (op, argument) pairs; arguments are resolved at run time."""
    rng = random.Random(seed)
    ops: list[tuple[int, int]] = []
    for _ in range(num_ops):
        r = rng.random()
        if r < 0.3:
            ops.append((POP, rng.randint(1, max_batch)))
        elif r < 0.6:
            ops.append((FREE, rng.randint(1, max_batch)))
        elif r < 0.9:
            ops.append((HIT, rng.randrange(1 << 30)))
        else:
            ops.append((WALK, rng.randint(1, 4 * max_batch)))
    return ops


def run_churn(
    name: str,
    queue: FreeKVCacheBlockQueue | ListFreeQueue,
    blocks: list[KVCacheBlock],
    workload: list[tuple[int, int]],
    time_budget_s: float,
) -> ChurnResult:
    """Drive ``queue`` through ``workload``; stop early past ``time_budget_s``."""
    result = ChurnResult(name)
    per_op = [0, 0, 0, 0]
    held: list[list[KVCacheBlock]] = []
    cursor: KVCacheBlock | None = None
    nblocks = len(blocks)
    perf = time.perf_counter
    start = perf()
    deadline = start + time_budget_s
    for i, (op, arg) in enumerate(workload):
        if op == POP:
            n = min(arg, queue.num_free_blocks)
            if n:
                got = queue.popleft_n(n)
                held.append(got)
                per_op[POP] += n
        elif op == FREE:
            if held:
                req = held.pop(arg % len(held))
                queue.append_n(reversed(req))
                per_op[FREE] += len(req)
        elif op == HIT:
            block = blocks[arg % nblocks]
            if block in queue:
                queue.remove(block)
                held.append([block])
                per_op[HIT] += 1
        else:
            if cursor is not None and cursor not in queue:
                cursor = None
            steps = 0
            for block in queue.iter_blocks_after(cursor):
                cursor = block
                steps += 1
                if steps >= arg:
                    break
            per_op[WALK] += steps
        if (i & 1023) == 0 and perf() > deadline:
            break
    result.seconds = perf() - start
    result.ops = sum(per_op)
    result.per_op = dict(zip(OP_NAMES, per_op))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks",
        type=argtypes.positive_int(50_000_000),
        default=100_000,
        help="queue size (default 100k)",
    )
    parser.add_argument(
        "--ops",
        type=argtypes.positive_int(100_000_000),
        default=400_000,
        help="operations in the workload",
    )
    parser.add_argument("--seed", type=argtypes.any_int(2**63 - 1, 0), default=0)
    parser.add_argument(
        "--baseline-seconds",
        type=argtypes.finite_float(0.0, 3600.0),
        default=5.0,
        help="time cap for the list baseline",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def bench(num_blocks: int, num_ops: int, seed: int, baseline_seconds: float) -> dict[str, object]:
    if num_blocks < 1 or num_ops < 1:
        raise ValueError("--blocks and --ops must be positive")
    workload = make_workload(num_ops, seed)
    results = {}
    for name, factory, budget in (
        ("intrusive", FreeKVCacheBlockQueue, float("inf")),
        ("list", ListFreeQueue, baseline_seconds),
    ):
        blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        queue = factory(blocks)
        results[name] = run_churn(name, queue, blocks, workload, budget)
    ours, base = results["intrusive"], results["list"]
    return {
        "num_blocks": num_blocks,
        "num_ops": num_ops,
        "intrusive_mops": ours.mops,
        "list_mops": base.mops,
        "speedup": ours.mops / base.mops if base.mops else float("inf"),
        "intrusive_link_ops": ours.ops,
        "list_link_ops": base.ops,
        "intrusive_per_op": ours.per_op,
        "list_ops_fraction_run": base.ops / ours.ops if ours.ops else 0.0,
    }


def run(args: argparse.Namespace) -> int:
    report = bench(args.blocks, args.ops, args.seed, args.baseline_seconds)
    if args.json:
        print(json.dumps(report))
        return 0
    from kvoffload.bench.console import console, table

    rows = [
        (name, f"{report[f'{k}_link_ops']:,}", f"{report[f'{k}_mops']:.2f}")
        for k, name in (
            ("intrusive", "intrusive (FreeKVCacheBlockQueue)"),
            ("list", "list baseline (list.remove)"),
        )
    ]
    title = f"free queue churn, {args.blocks:,} blocks, seed {args.seed}"
    out = console()
    out.print(table(title, ("queue", "link ops", "Mops/s"), rows, left=1))
    out.print(f"speedup: {report['speedup']:.1f}x over the list baseline")
    return 0
