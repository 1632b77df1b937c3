"""Hybrid replay: KV cache groups (full attention + sliding windows) on a CPU tier.

``kvoffload bench hybrid``. A hybrid model keeps one offloaded key per chunk
per KV cache group. Every request goes through the per-group logic of vLLM
0.33's offloading scheduler (``offloading/scheduler.py``), driven the same
way for kvoffload's ``CPUOffloadingManager`` and vLLM's own
``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``:

- lookup: the hit is the fixed point of the minimum over groups, full
  attention first (leading stored chunks), then sliding-window groups widest
  first (from the right, the last run of ``ceil(W / T)`` stored chunks; a run
  that reaches the chain's head counts whole); with a sliding-window group the
  last prompt token is recomputed, so the hit stops at ``(tokens - 1) // T``;
- load: full groups every hit chunk, sliding-window groups the last window;
- store: every group's chunks from the hit on, group after group in one
  ``prepare_store`` (every computed sliding-window chunk: vLLM's store mask
  with ``prefix_cache_retention_interval=None``; vLLM 0.33's default keeps
  only the window before the last prompt token, see ``--windows``), then
  ``complete_store`` of the keys taken.

``--windows`` prints ``hybrid_windows_bench``'s table instead: which
sliding-window chunks a store offers (vLLM 0.33's rule, KVOffloadConnector's
default extra windows) at equal bytes.

Rows: kvoffload's default policy with the group layout (the chunk-unit layer,
``kvoffload.offload.chunk_units``), the same policy without it (per key: the
ablation), kvoffload's ``lru`` with the layout, and vLLM's ``lru`` and ``arc``,
each fed the same key streams. Hit
rates are at equal CPU bytes: every row gets the same number of slots (vLLM
gives every group's key a slot of one size; so does this tier), printed with
the bytes per slot per group. Times are the scheduler side only (manager
calls plus the lookup logic, the same code for every row).

Workloads: ``long`` (seeded: sessions of 16 K-token prompts behind a few
shared system prompts, later turns extending earlier ones) for each layout
(``2g-w128``, ``2g-w1024``, ``4g-w128``, ``4g-w1024``: one full group plus one
or three sliding-window groups), and the Mooncake synthetic trace (512-token
blocks, one chunk each) on full + sliding window 1,024.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.bench.policy.hybrid_windows import (
    DENSE,
    Junctions,
    StoreRule,
    hit_chunks,
    learn_junction,
    store_keys,
)
from kvoffload.bench.policy.hybrid_workloads import (
    MOONCAKE_TRACE,
    _workloads,
)
from kvoffload.bench.policy.hybrid_workloads import (  # re-exported: the workloads' old home
    layouts as layouts,
)
from kvoffload.bench.policy.hybrid_workloads import (
    long_prompts as long_prompts,
)
from kvoffload.bench.policy.hybrid_workloads import (
    mooncake_prompts as mooncake_prompts,
)
from kvoffload.offload import DEFAULT_CACHE_POLICY, CPUOffloadingManager, OffloadKey
from kvoffload.offload.base import make_offload_key
from kvoffload.offload.chunk_units import GroupLayout
from kvoffload.offload.policies import CachePolicy

ROWS = (
    "kvoffload:default+units",
    "kvoffload:default/key",
    "kvoffload:lru+units",
    "vllm:lru",
    "vllm:arc",
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- the two managers behind one face ------------------------------------------------------


class _Side:
    """What the replay needs of a tier; counts key operations alike for every row."""

    ops = 0

    def prefix(self, keys: Sequence[OffloadKey]) -> int:
        raise NotImplementedError

    def has(self, key: OffloadKey) -> bool:
        raise NotImplementedError

    def load(self, keys: list[OffloadKey]) -> None:
        raise NotImplementedError

    def store(self, keys: list[OffloadKey]) -> None:
        raise NotImplementedError

    def begin(self, keys: Sequence[OffloadKey], tokens_per_chunk: int, num_groups: int) -> None:
        return None

    def end(self) -> None:
        return None


class _Ours(_Side):
    def __init__(
        self,
        slots: int,
        layout: tuple[GroupLayout, ...] | None,
        policy: str | type[CachePolicy] = DEFAULT_CACHE_POLICY,
    ) -> None:
        self.m = CPUOffloadingManager(slots, policy, group_layout=layout)

    def prefix(self, keys: Sequence[OffloadKey]) -> int:
        n = self.m.lookup(keys)
        self.ops += min(n + 1, len(keys))
        return n

    def has(self, key: OffloadKey) -> bool:
        self.ops += 1
        return self.m.lookup((key,)) == 1

    def load(self, keys: list[OffloadKey]) -> None:
        self.m.prepare_load(keys)
        self.m.complete_load(keys)
        self.ops += 2 * len(keys)

    def store(self, keys: list[OffloadKey]) -> None:
        flags = self.m.admit(keys)
        if flags is not None:
            keys = [k for k, f in zip(keys, flags) if f]
        self.ops += len(keys)
        out = self.m.prepare_store(keys)
        if out is not None and out.keys_to_store:
            self.m.complete_store(out.keys_to_store)
            self.ops += len(out.keys_to_store)


class _Vllm(_Side):
    def __init__(self, slots: int, policy: str) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

        self.m = VllmManager(slots, cache_policy=policy)
        self._hit = LookupResult.HIT
        self._ctx_cls = ReqContext
        self._n = 0
        self.ctx = ReqContext(req_id="0")

    def begin(self, keys: Sequence[OffloadKey], tokens_per_chunk: int, num_groups: int) -> None:
        # Keys carry their token positions, as vLLM's scheduler records them.
        self._n += 1
        self.ctx = ctx = self._ctx_cls(req_id=str(self._n))
        per_group = len(keys) // num_groups
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i % per_group + 1) * tokens_per_chunk)
        self.m.on_new_request(ctx)

    def end(self) -> None:
        self.m.on_request_finished(self.ctx)

    def prefix(self, keys: Sequence[OffloadKey]) -> int:
        n = 0
        lookup, ctx, hit = self.m.lookup, self.ctx, self._hit
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            n += 1
        self.ops += min(n + 1, len(keys))
        return n

    def has(self, key: OffloadKey) -> bool:
        self.ops += 1
        return self.m.lookup(key, self.ctx) is self._hit

    def load(self, keys: list[OffloadKey]) -> None:
        self.m.prepare_load(keys, self.ctx)
        self.m.complete_load(keys, self.ctx)
        self.ops += 2 * len(keys)

    def store(self, keys: list[OffloadKey]) -> None:
        self.ops += len(keys)
        out = self.m.prepare_store(keys, self.ctx)
        if out is not None and out.keys_to_store:
            self.m.complete_store(out.keys_to_store, self.ctx)
            self.ops += len(out.keys_to_store)


# -- vLLM's per-group load and store (its hit: ``hybrid_windows.hit_chunks``) ------------


@dataclass
class RowResult:
    row: str
    hit_tokens: int = 0
    tokens: int = 0
    ops: int = 0
    seconds: float = 0.0
    requests: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def us_per_request(self) -> float:
        return 1e6 * self.seconds / self.requests if self.requests else 0.0


def replay(
    side: _Side,
    row: str,
    prompts: Sequence[Sequence[int]],
    layout: tuple[GroupLayout, ...],
    rule: StoreRule = DENSE,
) -> RowResult:
    """Every prompt through vLLM's per-group logic on ``side``; hit tokens and key ops.

    ``rule``: which windowed-group chunks a store offers (``hybrid_windows``; the default,
    every chunk, is what this table has always measured)."""
    t = layout[0].tokens_per_chunk
    windows = [None if g.sliding_window is None else _cdiv(g.sliding_window, t) for g in layout]
    has_window = any(w is not None for w in windows)
    ngroups = len(layout)
    cache: dict[tuple[int, int], OffloadKey] = {}

    def key(c: int, g: int) -> OffloadKey:
        k = cache.get((c, g))
        if k is None:
            k = cache[(c, g)] = make_offload_key(c.to_bytes(8, "big"), g)
        return k

    streams = [[[key(c, g) for c in p] for g in range(ngroups)] for p in prompts]
    result = RowResult(row)
    junctions = Junctions()
    learn = rule.junctions and has_window
    seen: list[int] = []
    start = time.perf_counter()
    for prompt, keys in zip(prompts, streams):
        n = len(keys[0])
        side.begin([k for ks in keys for k in ks], t, ngroups)
        max_chunks = (n * t - 1) // t if has_window else n
        seen.clear()
        h = hit_chunks(side, keys, windows, max_chunks, seen) if n else 0
        if learn and seen:
            learn_junction(prompt[:max_chunks], seen[0], junctions)
        if h:
            side.load(
                [
                    k
                    for g, w in enumerate(windows)
                    for k in (keys[g][:h] if w is None else keys[g][max(0, h - w) : h])
                ]
            )
        if h < n:
            side.store(store_keys(rule, keys, windows, prompt, h, t, junctions))
        side.end()
        result.hit_tokens += h * t
        result.tokens += n * t
    result.seconds = time.perf_counter() - start
    result.ops = side.ops
    result.requests = len(streams)
    return result


def _side(row: str, slots: int, layout: tuple[GroupLayout, ...]) -> _Side:
    if row == "kvoffload:default+units":
        return _Ours(slots, layout)
    if row == "kvoffload:default/key":
        return _Ours(slots, None)
    if row == "kvoffload:lru+units":
        return _Ours(slots, layout, "lru")
    if row.startswith("vllm:"):
        return _Vllm(slots, row.split(":", 1)[1])
    raise ValueError(f"unknown row {row!r}")


def vllm_unavailable() -> str | None:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception as exc:  # any import failure: run kvoffload's rows only
        return f"{type(exc).__name__}: {exc}"
    return None


def bench(
    workloads: Sequence[tuple[str, tuple[GroupLayout, ...], list[list[int]]]],
    fractions: Sequence[float],
    rows: Sequence[str],
    bytes_per_token: Sequence[int],
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Every row on every workload at every capacity (a fraction of the distinct keys)."""
    out: list[dict[str, object]] = []
    for name, layout, prompts in workloads:
        t = layout[0].tokens_per_chunk
        unique = len({c for p in prompts for c in p}) * len(layout)
        slot_bytes = [
            t * bytes_per_token[min(g, len(bytes_per_token) - 1)] for g in range(len(layout))
        ]
        vllm_slot = max(slot_bytes)  # vLLM: one slot size for every group's key
        for frac in fractions:
            slots = max(1, round(frac * unique))
            results: dict[str, RowResult] = {}
            for row in rows:
                if progress:
                    progress(f"{name} @ {frac:.0%}: {row}")
                results[row] = replay(_side(row, slots, layout), row, prompts, layout)
            lru = results.get("vllm:lru")
            best_vllm = max(
                (r.hit_rate for k, r in results.items() if k.startswith("vllm:")), default=None
            )
            out.append(
                {
                    "workload": name,
                    "groups": [
                        {"kind": g.kind, "sliding_window": g.sliding_window, "slot_bytes": b}
                        for g, b in zip(layout, slot_bytes)
                    ],
                    "tokens_per_chunk": t,
                    "requests": len(prompts),
                    "distinct_keys": unique,
                    "capacity_fraction": frac,
                    "slots": slots,
                    "cpu_bytes": slots * vllm_slot,
                    "rows": {
                        k: {
                            "hit_rate": r.hit_rate,
                            "hit_vs_vllm_best": (r.hit_rate / best_vllm) if best_vllm else None,
                            "ops_per_s": r.ops_per_s,
                            "us_per_request": r.us_per_request,
                            "ops_vs_vllm_lru": (r.ops_per_s / lru.ops_per_s)
                            if lru and lru.ops_per_s
                            else None,
                        }
                        for k, r in results.items()
                    },
                }
            )
    return {"default_policy": DEFAULT_CACHE_POLICY, "points": out}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="long prompts per layout (200)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=16384, help="first-turn prompt (16384)"
    )
    parser.add_argument(
        "--tokens-per-chunk", type=int, default=64, help="tokens per offloaded chunk (64)"
    )
    parser.add_argument(
        "--capacity",
        default="0.05,0.2",
        help="CPU tier sizes, as fractions of the workload's distinct keys (0.05,0.2)",
    )
    parser.add_argument(
        "--layouts",
        default="2g-w128,2g-w1024,4g-w128,4g-w1024",
        help="group layouts of the long-prompt workload (comma-separated)",
    )
    parser.add_argument(
        "--mooncake",
        type=Path,
        default=MOONCAKE_TRACE,
        help="Mooncake trace replayed on full + sliding window 1,024 ('' to skip)",
    )
    parser.add_argument("--mooncake-requests", type=int, default=1500, help="its first N (1500)")
    parser.add_argument(
        "--bytes-per-token",
        default="4096",
        help="KV bytes per token per group, comma-separated per group (the last repeats); "
        "slots of every row are as large as the largest group's (vLLM's layout)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="kvoffload's rows only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--windows",
        action="store_true",
        help="extra sliding-window stores at equal bytes: KVOffloadConnector's default vs the "
        "same policy with vLLM's store rule vs vLLM's lru / arc (hybrid_windows_bench)",
    )


def _table(report: dict[str, object]) -> list[str]:
    lines = [
        f"{'workload':<20} {'cap':>5} {'slots':>7}  "
        + "  ".join(f"{r:>24}" for r in ROWS)
        + f"  {'default+units / vLLM best':>26}",
        " " * 36 + "  ".join(f"{'hit %  ops/s:lru    us/req':>24}" for _ in ROWS),
    ]
    for p in report["points"]:  # type: ignore[attr-defined]
        rows = p["rows"]
        cells = []
        for r in ROWS:
            x = rows.get(r)
            if x is None:
                cells.append(f"{'-':>24}")
                continue
            hit, ops, us = 100 * x["hit_rate"], x["ops_vs_vllm_lru"] or 0.0, x["us_per_request"]
            cells.append(f"{hit:6.2f}% {ops:5.2f}x {us:7.0f}us")
        ours = rows.get(ROWS[0], {}).get("hit_vs_vllm_best")
        lines.append(
            f"{p['workload']:<20} {p['capacity_fraction']:>5.0%} {p['slots']:>7}  "
            + "  ".join(cells)
            + (f"  {ours:>25.2f}x" if ours is not None else "")
        )
    return lines


def _group_label(group: dict[str, object]) -> str:
    window = group["sliding_window"]
    return f"{group['kind']}" + (f"/{window}" if window else "")


def run(args: argparse.Namespace) -> int:
    if args.windows:
        from kvoffload.bench.policy import hybrid_windows_bench

        return hybrid_windows_bench.run(args)
    rows = list(ROWS)
    reason = None if args.no_vllm else vllm_unavailable()
    if args.no_vllm or reason:
        rows = [r for r in rows if not r.startswith("vllm:")]
    fractions = [float(x) for x in args.capacity.split(",") if x]
    bpt = [int(x) for x in args.bytes_per_token.split(",") if x]
    work = _workloads(args)
    from kvoffload.bench.console import console as wide_console
    from kvoffload.bench.console import progress_bar

    total = len(work) * len(fractions) * len(rows)
    with progress_bar("replaying", total, show=not args.json) as advance:
        report = bench(work, fractions, rows, bpt, advance)
    if args.json:
        report["vllm"] = reason or ("not requested" if args.no_vllm else "0.33 managers")
        print(json.dumps(report))
        return 0
    console = wide_console(200)  # piped: keep each table row on one line
    if reason:
        console.print(f"vLLM rows skipped: {reason}")
    console.print(
        "hit rate (tokens served from the CPU tier / prompt tokens), block ops/s vs vLLM lru, "
        "scheduler-side time per request; equal CPU bytes: every row has the same slots"
    )
    for line in _table(report):
        console.print(line, highlight=False)
    for p in report["points"]:  # type: ignore[attr-defined]
        if p["capacity_fraction"] == fractions[0]:
            sizes = ", ".join(_group_label(g) + f": {g['slot_bytes']} B" for g in p["groups"])
            console.print(f"{p['workload']}: bytes per slot per group: {sizes}", highlight=False)
    return 0
