"""``kvoffload bench route``: N engines behind a KV-aware router, vs round robin and random.

Every router serves the same requests from the same empty state; reported per workload
(the multi-turn chat, the Mooncake synthetic trace), instance count and router: prefix hit
rate per tier, prefill tokens computed (and as a ratio of round robin's), TTFT p50 / p99
(noisy on a shared machine), and the share of requests, among those some instance held a
prefix of, sent to the instance holding the longest one. The pieces (instances, Dynamo's
indexer, the shared Redis tier, the routers) and design notes: docs/routing.md.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (engine_args does too)

from kvoffload.bench import plots
from kvoffload.bench.routing.routers import ROUTERS
from kvoffload.bench.routing.workloads import DEFAULT_MOONCAKE_TRACE, WORKLOADS
from kvoffload.cli import argtypes

if TYPE_CHECKING:
    from kvoffload.bench.routing.routed_run import RunResult
    from kvoffload.bench.routing.workloads import RouteRequest
    from kvoffload.engine.config import EngineConfig


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 or v > 64 for v in values):
        raise argparse.ArgumentTypeError(f"instance counts must be 1..64, got {text!r}")
    return values


def _names(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(known)}; got {text!r}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos = argtypes.positive_int
    parser.add_argument("--instances", type=_int_list, default=[2, 4], help="e.g. 2,4")
    parser.add_argument("--workloads", type=_names(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--routers", type=_names(ROUTERS), default=list(ROUTERS))
    parser.add_argument("--requests", type=pos(100_000), default=120, help="per workload")
    parser.add_argument(
        "--concurrency",
        type=pos(4096),
        default=None,
        help="requests unfinished at once across instances (default: 2 per instance)",
    )
    e = parser.add_argument_group("each instance")
    e.add_argument("--block-size", type=pos(1024), default=16)
    e.add_argument("--gpu-blocks", type=pos(1 << 20, minimum=2), default=48)
    e.add_argument("--cpu-blocks", type=pos(1 << 24), default=96)
    e.add_argument("--max-num-seqs", type=pos(1024), default=4)
    e.add_argument("--seed", type=int, default=0)
    m = parser.add_argument_group("Mooncake trace")
    m.add_argument("--mooncake-trace", default=DEFAULT_MOONCAKE_TRACE)
    m.add_argument(
        "--mooncake-max-blocks",
        type=pos(4096),
        default=16,
        help="hash ids kept per prompt (one block each): the reference engine is small",
    )
    s = parser.add_argument_group("services (give URLs when they run elsewhere)")
    s.add_argument("--redis-url", default=None, help="shared Redis tier; default: start one")
    s.add_argument("--no-redis", action="store_true", help="no shared tier")
    s.add_argument("--indexer-url", default=None, help="Dynamo indexer; default: start one")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the instances' event sockets are reached at (the indexer connects)",
    )
    parser.add_argument("--plot", default="route.png", help="where the plot goes ('' for none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _workloads(args: argparse.Namespace, vocab: int) -> dict[str, list[RouteRequest]]:
    from kvoffload.bench.routing.workloads import chat_requests, mooncake_requests

    workloads = {}
    for name in args.workloads:
        if name == "chat":
            workloads[name] = chat_requests(args.requests, vocab, seed=args.seed)
        else:
            workloads[name] = mooncake_requests(
                args.mooncake_trace,
                args.requests,
                args.block_size,
                vocab,
                max_blocks=args.mooncake_max_blocks,
                seed=args.seed,
            )
    return workloads


def _route_all(
    args: argparse.Namespace, workloads: dict[str, list[RouteRequest]], base: EngineConfig
) -> list[RunResult]:
    """Every workload x instance count x router, on engine processes started once."""
    from contextlib import ExitStack

    from kvoffload.bench.console import progress_bar
    from kvoffload.bench.routing.indexer import DynamoIndexer, IndexerClient
    from kvoffload.bench.routing.routed_run import run_routed
    from kvoffload.bench.routing.routers import make_router
    from kvoffload.bench.routing.services import LocalRedis
    from kvoffload.bench.routing.worker import EngineProcess

    results: list[RunResult] = []
    with ExitStack() as stack:
        if args.indexer_url:
            indexer = IndexerClient(args.indexer_url)
        else:
            indexer = stack.enter_context(DynamoIndexer()).client
        redis_url = None
        if not args.no_redis:
            redis_url = args.redis_url or stack.enter_context(LocalRedis()).url
        # One process per instance for every run (torch loads once); each run
        # builds fresh engines in them.
        processes = [EngineProcess(i) for i in range(max(args.instances))]
        for proc in processes:
            stack.callback(proc.close)
        total = sum(len(w) for w in workloads.values()) * len(args.instances) * len(args.routers)
        with progress_bar("routing", total, show=not args.json) as advance:
            for name, requests in workloads.items():
                for n in args.instances:
                    for router_name in args.routers:
                        advance(0, f"{name} N={n} {router_name}")
                        results.append(
                            run_routed(
                                name,
                                requests,
                                processes[:n],
                                make_router(router_name, args.seed, args.block_size),
                                base,
                                indexer,
                                redis_url,
                                args.concurrency or 2 * n,
                                host=args.host,
                                on_done=advance,
                            )
                        )
    return results


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.routing.report import plot, print_table, vs_baseline
    from kvoffload.engine.config import EngineConfig
    from kvoffload.engine.model_runner import peek_vocab_size

    if args.plot:
        plots.require("kvoffload bench route")
    base = EngineConfig(
        seed=args.seed,
        block_size=args.block_size,
        num_gpu_blocks=args.gpu_blocks,
        num_cpu_blocks=args.cpu_blocks,
        max_num_seqs=args.max_num_seqs,
        num_threads=1,
        transfer_threads=1,
    )
    results = _route_all(args, _workloads(args, peek_vocab_size(base)), base)
    plotted = plot(results, args.plot) if args.plot else None
    if args.json:
        ratios = vs_baseline(results)
        print(
            json.dumps(
                {
                    "results": [r.as_dict() for r in results],
                    "prefill_vs_round_robin": {
                        f"{w}/{n}/{r}": round(x, 4) for (w, n, r), x in ratios.items()
                    },
                    "plot": str(plotted) if plotted else None,
                }
            )
        )
        return 0
    print_table(results, "kvoffload bench route (TTFT noisy: 2 shared cores)")
    if plotted:
        print(f"plot: {plotted}")
    return 0
