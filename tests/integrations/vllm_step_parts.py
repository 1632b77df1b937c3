"""Steps every vLLM rig plays the same way: a worker connector's step tail, the runner output.

Import only from test modules that called ``need_vllm()`` first.

Shared by ``vllm_rig`` and ``vllm_groups_rig`` (one process) and by
``vllm_tp_rig`` and ``vllm_groups_tp_rig`` (one worker process per rank).
What differs between the rigs (how a block is written and checked, which
loads are pending) stays in each rig and comes in as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

#: The token every rig "samples" once a request's prompt is computed.
SAMPLED_TOKEN = 7


def finish_worker_step(
    wc: Any,
    finished_req_ids: set[str],
    pending: Iterable[int],
    in_flight: Callable[[], Container[int]],
    verify: Callable[[list[int]], None],
) -> KVConnectorOutput:
    """After the forward pass: save, collect finished jobs, verify the loads that ended.

    The order is vLLM's model runner's: ``wait_for_save`` before ``get_finished``.
    ``pending`` is read before ``get_finished`` (which ends jobs), ``in_flight``
    after it, so ``verify`` gets exactly the pending loads that are no longer
    in flight. The connector's metadata is cleared on return.
    """
    wc.wait_for_save()
    before = set(pending)
    finished_sending, finished_recving = wc.get_finished(finished_req_ids)
    still = in_flight()
    verify([j for j in before if j not in still])
    output = KVConnectorOutput(
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        invalid_block_ids=wc.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=wc.build_connector_worker_meta(),
    )
    wc.clear_connector_metadata()
    return output


def runner_output(scheduler: Any, output: Any, kv_output: Any) -> ModelRunnerOutput:
    """The model runner's answer to ``output``: one token for each request whose prompt is done.

    A request still computing its prompt (chunked prefill, or waiting for a
    load) samples nothing, as vLLM's runner does for a partial prefill.
    """
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([SAMPLED_TOKEN] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )


def finish_reasons(outputs: list[Any]) -> dict[str, str]:
    """Each finished request's finish reason, by request id, from the scheduler's step outputs."""
    return {
        o.request_id: str(o.finish_reason)
        for outs in outputs
        for eco in outs.values()
        for o in eco.outputs
        if o.finished
    }


def has_pending_work(scheduler: Any) -> bool:
    """Whether the scheduler-side offload manager still waits on lower-tier work.

    Only vLLM's tiering manager has ``has_pending_work``; a manager without it
    (the CPU tier alone) never waits on anything outside the workers.
    """
    manager = scheduler.connector.connector_scheduler.manager
    pending = getattr(manager, "has_pending_work", None)
    return bool(pending()) if pending is not None else False


def prefix_hash_fn(config: Any) -> Any:
    """The config's prefix-caching hash, with vLLM's NONE_HASH seeded by it (as the engine does).

    Call before building requests or a scheduler: block hashes chain from NONE_HASH.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return hash_fn


def new_scheduler(
    config: Any, kcc: Any, block_size: int, scheduler_cls: type[Scheduler] = Scheduler
) -> Scheduler:
    """vLLM's scheduler over ``kcc`` with stats on; call inside ``set_current_vllm_config``."""
    from vllm.v1.structured_output import StructuredOutputManager

    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )
