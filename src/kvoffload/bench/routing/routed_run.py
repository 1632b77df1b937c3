"""One routed run: N engine instances, one router, one list of requests.

Every run starts from the same state: fresh engine processes (empty GPU and
CPU tiers), an emptied shared Redis tier, and a model name of its own at the
indexer (so no run sees another's index). Requests are sent in order, at most
``concurrency`` unfinished at once across all instances; for each one the
indexer is asked for every instance's overlap (for every router, so the
"sent to the holder of the longest prefix" share is measured alike), the
router picks, and the request goes to that instance's process.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, cast

import numpy as np

from kvoffload.bench.routing.indexer import IndexerClient, TierOverlap, free_port
from kvoffload.bench.routing.routers import Load, Router
from kvoffload.bench.routing.services import flush_redis
from kvoffload.bench.routing.worker import (
    EngineProcess,
    EngineStats,
    InstanceEndpoints,
    RequestRecord,
)
from kvoffload.bench.routing.workloads import RouteRequest
from kvoffload.engine.config import EngineConfig

# Lets the indexer's subscriptions connect before the first event is published
# (anything earlier is recovered through replay, but only once a later batch shows the gap).
SUBSCRIBE_SETTLE_S = 0.3
_instance_ids = itertools.count(1)


@dataclass
class RunResult:
    workload: str
    instances: int
    router: str
    requests: int
    prompt_tokens: int
    prefill_tokens_computed: int
    hit_rate_gpu: float
    hit_rate_cpu: float
    hit_rate_redis: float
    ttft_p50_s: float
    ttft_p99_s: float
    sent_to_longest_prefix: float  # share of requests with a holder that went to it
    requests_with_holder: int
    requests_per_instance: list[int]
    wall_s: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def run_routed(
    workload: str,
    requests: Sequence[RouteRequest],
    processes: Sequence[EngineProcess],
    router: Router,
    base_config: EngineConfig,
    indexer: IndexerClient,
    redis_url: str | None,
    concurrency: int,
    host: str = "127.0.0.1",
    on_done: Callable[[], None] | None = None,
) -> RunResult:
    """Serve ``requests`` through ``router`` over a fresh engine in each of ``processes``."""
    if redis_url is not None:
        flush_redis(redis_url)
    n = len(processes)
    model = f"route-{workload}-{n}-{router.name}-{uuid.uuid4().hex[:8]}"
    started: list[EngineProcess] = []
    try:
        for proc in processes:
            port, replay = free_port(), free_port()
            ep = InstanceEndpoints(
                next(_instance_ids), f"tcp://{host}:{port}", f"tcp://{host}:{replay}"
            )
            cfg = replace(
                base_config,
                redis_url=redis_url,
                events_endpoint=ep.events,
                events_replay_endpoint=ep.replay,
            )
            proc.start_engine(ep, cfg)
            started.append(proc)
        for proc in processes:
            proc.wait_ready()
            e = proc.endpoints
            assert e is not None
            indexer.register(e.instance_id, e.events, e.replay, model, base_config.block_size)
        time.sleep(SUBSCRIBE_SETTLE_S)
        result = _dispatch(
            workload, requests, list(processes), router, indexer, model, concurrency, on_done
        )
        started.clear()  # _dispatch stopped them
        return result
    finally:
        for proc in started:  # a failed run: end the engines so the processes can be reused
            with contextlib.suppress(RuntimeError, OSError):
                proc.stop()


def _dispatch(
    workload: str,
    requests: Sequence[RouteRequest],
    instances: list[EngineProcess],
    router: Router,
    indexer: IndexerClient,
    model: str,
    concurrency: int,
    on_done: Callable[[], None] | None,
) -> RunResult:
    n = len(instances)
    index_of = {inst.endpoints.instance_id: i for i, inst in enumerate(instances) if inst.endpoints}
    loads = [Load() for _ in range(n)]
    placed: dict[str, tuple[int, int]] = {}  # req_id -> (instance, estimated prefill)
    outputs: list[RequestRecord] = []
    pending = deque(requests)
    sent_to_best = with_holder = 0
    per_instance = [0] * n
    start = time.perf_counter()
    conns = {inst.conn: i for i, inst in enumerate(instances)}
    while pending or placed:
        while pending and len(placed) < concurrency:
            req = pending.popleft()
            answer = indexer.query(req.token_ids, model)
            overlaps = {index_of[k]: v for k, v in answer.items() if k in index_of}
            choice = router.pick(len(req.token_ids), overlaps, loads, req.token_ids)
            router.sent(choice, req.token_ids)
            mine = overlaps.get(choice, TierOverlap())
            best = max((o.longest_matched for o in overlaps.values()), default=0)
            if best > 0:
                with_holder += 1
                sent_to_best += mine.longest_matched == best
            estimate = max(0, len(req.token_ids) - mine.disk)
            loads[choice].requests += 1
            loads[choice].prefill_tokens += estimate
            placed[req.req_id] = (choice, estimate)
            per_instance[choice] += 1
            instances[choice].add(req.req_id, req.token_ids, req.max_tokens, req.continues)
        for conn in wait(list(conns)):
            # wait() returns what it was given: our instances' connections.
            msg = instances[conns[cast("Connection[Any, Any]", conn)]].recv()  # raises on error
            if msg[0] != "out":
                continue
            out: RequestRecord = msg[1]
            i, estimate = placed.pop(str(out["req_id"]))
            loads[i].requests -= 1
            loads[i].prefill_tokens -= estimate
            outputs.append(out)
            if on_done is not None:
                on_done()
    wall = time.perf_counter() - start
    stats = [inst.stop() for inst in instances]
    return _summarise(
        workload, n, router.name, outputs, stats, sent_to_best, with_holder, per_instance, wall
    )


def _summarise(
    workload: str,
    n: int,
    router: str,
    outputs: list[RequestRecord],
    stats: list[EngineStats],
    sent_to_best: int,
    with_holder: int,
    per_instance: list[int],
    wall: float,
) -> RunResult:
    def total(key: Literal["prompt_len", "tier_hit", "computed", "gpu_hit"]) -> int:
        return sum(int(o[key]) for o in outputs)

    prompt = total("prompt_len")
    tier_hit = total("tier_hit")
    cpu = redis = 0
    for s in stats:
        tiers = s.get("tiers") or {}
        cpu += int(tiers.get("cpu_hit_tokens", 0))
        redis += int(tiers.get("lower_hit_tokens", 0))
    if cpu + redis == 0:
        cpu = tier_hit  # no lower tier: every tier hit came from the CPU
    ttfts = np.array([float(o["ttft_s"]) for o in outputs] or [0.0])
    return RunResult(
        workload=workload,
        instances=n,
        router=router,
        requests=len(outputs),
        prompt_tokens=prompt,
        prefill_tokens_computed=total("computed"),
        hit_rate_gpu=total("gpu_hit") / prompt if prompt else 0.0,
        hit_rate_cpu=cpu / prompt if prompt else 0.0,
        hit_rate_redis=redis / prompt if prompt else 0.0,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        sent_to_longest_prefix=sent_to_best / with_holder if with_holder else 0.0,
        requests_with_holder=with_holder,
        requests_per_instance=per_instance,
        wall_s=wall,
    )
