"""Where a CPU-tier hit's time goes inside a real vLLM engine: a timed ``KVOffloadConnector``.

``kvoffload bench vllm --profile-hit`` names this connector
(``"kv_connector": "ProfiledKVOffloadConnector"``,
``"kv_connector_module_path": "kvoffload.bench.vllm.hit_profile"``); it is
``KVOffloadConnector`` with every hook timed (``time.perf_counter``, around
the call, nothing inside changed) and one JSON line appended to
``$KVOFFLOAD_HIT_PROFILE.<role>.<pid>.jsonl`` per event:

- scheduler side, once per request that hit kvoffload's tier, when it is
  scheduled: ``{"kind": "hit", "lookup_s", "alloc_s", "steps_waited",
  "wait_s", "hit_tokens", "sync"}``. ``steps_waited``: engine steps between
  the first lookup that found the hit and the step that computes the request
  (0: the same step); ``wait_s``: the time between the two;
- scheduler side, per step: ``{"kind": "sched_step", "meta_s",
  "update_s"}`` (metadata building, worker-output handling), only for steps
  that carried or finished a load;
- worker side, per step with a load: ``{"kind": "load_step", "start_s",
  "load_bytes", "sync_ids", "async_ids"}`` and per finished load
  ``{"kind": "load_done", "job_id", "bytes", "seconds", "wall_s", "copy_s",
  "copy_cpu_s"}`` (``seconds``: what vLLM's metric got; the others kvoffload's
  ``TransferResult``: submit to done, its copies' wall and CPU time); per step:
  ``{"kind": "worker_step", "finished_s", "meta_s", "errors_s"}``; per step
  with a load, the forward pass's waits for it: ``{"kind": "forward_waits",
  "layer_s", "save_s"}`` (``wait_for_layer_load`` summed, ``wait_for_save``);
- worker side, the step after a synchronous load: one bulk copy of the same
  number of bytes on the same thread from memory as cold as a load's,
  ``{"kind": "bulk", "bytes", "seconds", "hot_seconds", "torch_threads"}`` (then the same
  copy again, cache-hot), the reference a load's GB/s is compared with (it
  runs after the hit's first token, so it never delays a hit).

The writes come after the timed calls; a line costs tens of microseconds.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from kvoffload.bench.vllm.hits import STAGE_ENV
from kvoffload.integrations.vllm.connector import KVOffloadConnector

PROFILE_ENV = "KVOFFLOAD_HIT_PROFILE"
#: Buffer pairs the bulk reference cycles through (8 x 2 x 12 MB: six times a 32 MiB L3).
BULK_BUFFERS = 8


class _Sink:
    def __init__(self, role: str) -> None:
        base = os.environ.get(PROFILE_ENV)
        self.path = f"{base}.{role}.{os.getpid()}.jsonl" if base else None

    def write(self, **record: Any) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _spy(real: Any, into: list[Any] | dict[int, Any]) -> Any:
    """``real`` (a ``get_finished``) that also keeps what it returns ``into``."""

    def spy() -> Any:
        out = real()
        if isinstance(into, list):
            into.extend(out)
        else:
            into.update((r.job_id, r) for r in out)
        return out

    return spy


class ProfiledKVOffloadConnector(KVOffloadConnector):
    """``KVOffloadConnector`` with its hooks timed; see the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        side = "scheduler" if self.connector_scheduler is not None else "worker"
        self._sink = _Sink(side)
        self._step = 0
        # scheduler side: req id -> [first hit step, lookup s, alloc s, hit tokens, sync,
        # time of the first lookup that found the hit]
        self._hits: dict[str, list[Any]] = {}
        self._step_had_load = False
        # worker side
        self._layer_wait_s = 0.0  # this step's time in wait_for_layer_load
        self._bulk_due = 0
        self._bulk_src: torch.Tensor | None = None
        self._bulk_dst: torch.Tensor | None = None
        self._bulk_turn = 0
        self._finished_s = 0.0
        self._load_step = False
        self._load_ids: set[int] = set()

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t = time.perf_counter()
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        dt = time.perf_counter() - t
        if hit:
            entry = self._hits.setdefault(request.request_id, [self._step, 0.0, 0.0, 0, False, t])
            entry[1] += dt
            entry[3] = hit
            entry[4] = not is_async
        return hit, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        t = time.perf_counter()
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        entry = self._hits.get(request.request_id)
        if entry is not None and num_external_tokens:
            entry[2] += time.perf_counter() - t
            self._step_had_load = True

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        t = time.perf_counter()
        meta = super().build_connector_meta(scheduler_output)
        meta_s = time.perf_counter() - t
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        scheduled += list(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
        for req_id in scheduled:
            entry = self._hits.pop(req_id, None)
            if entry is not None:
                self._sink.write(
                    kind="hit",
                    req_id=req_id,
                    steps_waited=self._step - entry[0],
                    # From the lookup that found the hit to the end of the step's
                    # scheduling: the wait before the request is computed.
                    wait_s=time.perf_counter() - entry[5],
                    lookup_s=entry[1],
                    alloc_s=entry[2],
                    hit_tokens=entry[3],
                    sync=entry[4],
                )
        if self._step_had_load or meta.load_jobs:
            self._sink.write(kind="sched_step", step=self._step, meta_s=meta_s)
        self._step_had_load = False
        self._step += 1
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        t = time.perf_counter()
        super().update_connector_output(connector_output)
        dt = time.perf_counter() - t
        if connector_output.finished_recving:
            self._sink.write(kind="sched_update", update_s=dt)

    # -- worker side ---------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        jobs = dict(getattr(meta, "load_jobs", {}) or {})
        if not jobs and self._bulk_due:
            self._bulk_copy(self._bulk_due)
            self._bulk_due = 0
        t = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        start_s = time.perf_counter() - t
        self._load_step = bool(jobs)
        if not jobs:
            return
        self._load_ids.update(jobs)
        sync_ids = [j for j, e in jobs.items() if getattr(e, "sync", False)]
        sync_ids += sorted(getattr(meta, "sync_load_jobs", ()) or ())
        async_ids = [j for j in jobs if j not in sync_ids]
        nbytes = self._job_bytes(jobs, sync_ids)
        self._sink.write(
            kind="load_step",
            start_s=start_s,
            load_bytes=nbytes,
            sync_ids=sync_ids,
            async_ids=async_ids,
        )
        if sync_ids:
            self._bulk_due = nbytes

    def _job_bytes(self, jobs: dict[int, Any], ids: list[int]) -> int:
        worker = self.kvoffload_worker
        if worker is None:
            return 0
        per_block = worker.layout.bytes_per_block
        return sum(len(jobs[j].dst_spec.block_ids) * per_block for j in ids)

    def _bulk_copy(self, nbytes: int) -> None:
        # A load reads CPU slots written requests ago and writes KV blocks last
        # used as long ago: cold in the caches. The reference does the same: it
        # cycles through BULK_BUFFERS pairs (more than the L3 holds), then copies
        # the last pair again, hot, for comparison.
        if self._bulk_src is None or self._bulk_src.shape[1] < nbytes:
            self._bulk_src = torch.ones(BULK_BUFFERS, nbytes, dtype=torch.uint8)
            self._bulk_dst = torch.ones(BULK_BUFFERS, nbytes, dtype=torch.uint8)
        assert self._bulk_dst is not None
        k = self._bulk_turn % BULK_BUFFERS
        self._bulk_turn += 1
        src, dst = self._bulk_src[k, :nbytes], self._bulk_dst[k, :nbytes]
        t = time.perf_counter()
        dst.copy_(src)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        dst.copy_(src)
        hot = time.perf_counter() - t
        self._sink.write(
            kind="bulk",
            bytes=nbytes,
            seconds=cold,
            hot_seconds=hot,
            torch_threads=torch.get_num_threads(),
        )

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        forced = os.environ.get(STAGE_ENV)
        worker = self.kvoffload_worker
        if forced is not None and worker is not None:
            worker.stage_loads = forced == "1"

    def wait_for_layer_load(self, layer_name: str) -> None:
        t = time.perf_counter()
        super().wait_for_layer_load(layer_name)
        self._layer_wait_s += time.perf_counter() - t

    def wait_for_save(self) -> None:
        t = time.perf_counter()
        super().wait_for_save()
        save_s = time.perf_counter() - t
        if self._load_step:
            self._sink.write(kind="forward_waits", layer_s=self._layer_wait_s, save_s=save_s)
        self._layer_wait_s = 0.0

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self.kvoffload_worker
        results: list[Any] = []
        jobs: dict[int, Any] = {}  # kvoffload's own results: the job's wall and copy times
        inner = getattr(worker, "worker", None)
        if worker is not None:
            worker.get_finished = _spy(worker.get_finished, results)  # type: ignore[method-assign]
            if inner is not None:
                inner.get_finished = _spy(inner.get_finished, jobs)
        t = time.perf_counter()
        try:
            out = super().get_finished(finished_req_ids)
        finally:
            if worker is not None:
                del worker.get_finished  # back to the class's method
            if inner is not None:
                del inner.get_finished
        self._finished_s = time.perf_counter() - t
        for r in results:
            if r.job_id not in self._load_ids:
                continue
            self._load_ids.discard(r.job_id)
            if r.transfer_size:
                job = jobs.get(r.job_id)
                self._sink.write(
                    kind="load_done",
                    job_id=r.job_id,
                    bytes=r.transfer_size,
                    seconds=r.transfer_time,
                    wall_s=getattr(job, "seconds", None),
                    copy_s=getattr(job, "copy_seconds", None),
                    copy_cpu_s=getattr(job, "copy_cpu_seconds", None),
                )
        return out

    def build_connector_worker_meta(self) -> Any:
        t = time.perf_counter()
        meta = super().build_connector_worker_meta()
        meta_s = time.perf_counter() - t
        if self._load_step or self._finished_s > 1e-3:
            self._sink.write(kind="worker_step", finished_s=self._finished_s, meta_s=meta_s)
        self._load_step = False
        return meta
