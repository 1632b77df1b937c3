"""Continuous batching: waiting and running queues, chunked prefill, preemption.

Each ``schedule()`` fills one step's token budget: running requests first
(decode or the next prefill chunk), then new or resumed ones from the waiting
queue. When GPU blocks run out, the most recently admitted running request
is preempted by recompute: its blocks are freed and it goes back to the
front of the waiting queue (its output so far is kept and becomes prompt).

A new request's prefix comes first from the GPU prefix cache, then from the
offload tier through the connector; a tier hit parks the request in
``WAITING_FOR_LOAD`` until the worker has copied the blocks in. While a
lower tier is still asking whether it holds a new request's next block
(Redis presence, off the scheduler thread), the connector defers the
request: it keeps its place in the queue, the requests behind it may start,
and it is tried again next step (a bounded number of times).

Queue hints: a request's full blocks are announced to the offload tier
(``hint_queued``) while it waits without GPU blocks: on arrival, when
preempted, when its blocks are given back; ``hint_dequeued`` when it is
admitted, aborted or finished. A finished request with ``continues`` set
announces its blocks with ``hint_continues`` (a session hint).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvoffload.engine.connector import OffloadingConnectorScheduler
from kvoffload.engine.kv_cache_manager import KVCacheManager
from kvoffload.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # (request, number of tokens to compute this step), in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # waiting requests whose tier lookup is still being answered: tried again next step
    deferred: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        connector: OffloadingConnectorScheduler | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.num_preemptions = 0
        self._hinted: set[str] = set()  # requests announced with hint_queued, not yet dequeued

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self._hint_queued(request)

    def _hint_queued(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.request_queued(req.req_id, req.block_hashes)
            self._hinted.add(req.req_id)

    def _hint_dequeued(self, req: Request) -> None:
        if req.req_id in self._hinted:
            self._hinted.discard(req.req_id)
            assert self.connector is not None
            self.connector.request_dequeued(req.req_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # -- scheduling -----------------------------------------------------------

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        if self.connector is not None:
            self.connector.request_preempted(victim.req_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        self._hint_queued(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted by an earlier request this step
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                if victim.req_id in scheduled_ids:
                    # Only requests already in this batch could be given up; keep them.
                    victim = req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                scheduled_ids.add(req.req_id)
                budget -= num_new

        if out.preempted:
            return out  # no admissions in a step that had to preempt

        budget = self._admit_waiting(budget, out)
        # Requests whose loads finished hold blocks while waiting; if they hold
        # so many that the head of the queue cannot start, nothing would ever
        # run. Give back the others' blocks (they are in the prefix cache now,
        # so they come back as GPU hits) and retry.
        stuck = not out.scheduled and not self.running and not self.loading and bool(self.waiting)
        stuck = stuck and not out.deferred  # a deferred request starts next step on its own
        if stuck and self._release_waiting_blocks():
            self._admit_waiting(budget, out)
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            admitted = self._admit(req, budget, out)
            if admitted is None:
                deferred.append(req)
                continue
            if not admitted:
                self.waiting.appendleft(req)
                break
            self._hint_dequeued(req)
            if req.status is RequestStatus.RUNNING:
                budget -= out.scheduled[-1][1]
        self.waiting.extendleft(reversed(deferred))  # they keep their places at the front
        out.deferred += deferred
        return budget

    def _release_waiting_blocks(self) -> bool:
        released = False
        for req in list(self.waiting)[1:]:
            if req.blocks:
                self.kv.free(req)
                req.num_computed_tokens = 0
                if self.connector is not None:
                    self.connector.request_preempted(req.req_id)
                self._hint_queued(req)
                released = True
        return released

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> bool | None:
        """Start ``req``: prefix hits, maybe a tier load, else a first chunk.

        False: no GPU room (stop admitting); None: its tier lookup is deferred.
        """
        hit_blocks = []
        if not req.blocks:
            hit_blocks = self.kv.get_computed_blocks(req)
            num_gpu = len(hit_blocks) * self.kv.block_size
            num_ext = 0
            if self.connector is not None:
                if hit_blocks:
                    self.connector.touch_gpu_hit(req.block_hashes, len(hit_blocks))
                matched = self.connector.get_num_new_matched_tokens(
                    req.req_id, req.block_hashes, num_gpu, req.num_tokens
                )
                if matched is None:
                    return None
                num_ext = matched
            if req.num_gpu_hit_tokens is None:
                req.num_gpu_hit_tokens = num_gpu
                req.num_tier_hit_tokens = num_ext
            req.num_computed_tokens = num_gpu
            if num_ext > 0:
                if not self.kv.allocate_slots(req, num_ext, hit_blocks):
                    req.num_computed_tokens = 0
                    return False
                assert self.connector is not None
                self.connector.update_state_after_alloc(req.req_id, req.blocks, num_ext)
                req.num_external_tokens = num_ext
                req.status = RequestStatus.WAITING_FOR_LOAD
                self.loading[req.req_id] = req
                return True
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.kv.allocate_slots(req, num_new, hit_blocks):
            if not req.blocks:
                req.num_computed_tokens = 0
            return False
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append((req, num_new))
        return True

    # -- load completion ------------------------------------------------------

    def finish_loads(self, loaded: set[str], failed: set[str]) -> None:
        """Loaded requests get their tier tokens; failed ones recompute them."""
        for req_id in loaded | failed:
            req = self.loading.pop(req_id, None)
            if req is None:
                continue
            if req_id in loaded:
                req.num_computed_tokens += req.num_external_tokens
                self.kv.cache_blocks(req, req.num_computed_tokens)
            else:
                # The blocks stay allocated; their content is garbage until recomputed,
                # and they are not in the prefix cache, so nobody can hit them.
                req.num_tier_hit_tokens = 0
            req.num_external_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    # -- finish ---------------------------------------------------------------

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        self.loading.pop(req.req_id, None)
        if req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self._hint_dequeued(req)
        if self.connector is not None:
            self.connector.request_finished(req.req_id)
            if req.continues and status is RequestStatus.FINISHED:
                self.connector.request_continues(req.block_hashes)
        req.status = status
