"""kvoffload's policies inside vLLM 0.33's own CPU tier (``KVOffload<Name>Policy``).

vLLM's real ``CPUOffloadingManager`` loads each class by name through its
``CachePolicyFactory`` (``cache_policy_module_path="kvoffload.integrations.vllm"``)
and replays a generated trace as vLLM's offloading connector drives it; the
same trace through kvoffload's own manager with the same policy
(``kvoffload bench offload``'s replay) gives the same hits, block by block.
"""

from tests.vllm_required import need_vllm

need_vllm()

import random  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory  # noqa: E402

import kvoffload.integrations.vllm as kv_vllm  # noqa: E402
from kvoffload.bench.policy.replay import replay as kvoffload_replay  # noqa: E402
from kvoffload.bench.policy.traces import generate, trace_keys, trace_times  # noqa: E402
from kvoffload.integrations.vllm.scheduler.policies import (  # noqa: E402
    KVOffloadVLLMPolicy,
    policy_class_name,
)
from kvoffload.offload import OffloadKey  # noqa: E402
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY  # noqa: E402
from kvoffload.offload.policies import policy_names  # noqa: E402
from tests.integrations.vllm_rig import kv_cache_config, vllm_config, write_tiny_llama  # noqa: E402
from tests.offload.hint_policy import queue_aware_policies  # noqa: E402

MODULE = "kvoffload.integrations.vllm"
TOKENS = 512


def vllm_replay(
    trace: Sequence[Sequence[OffloadKey]],
    class_name: str,
    capacity: int,
    times: Sequence[float] | None = None,
    lookahead_ms: float = 0.0,
) -> list[int]:
    """Hits per request of vLLM's CPU manager running ``class_name`` (as its connector calls it).

    With ``times``, queue hints go to the policy as kvoffload's connector sends
    them, at the points ``kvoffload bench offload --lookahead-s`` sends them.
    """
    m = CPUOffloadingManager(capacity, cache_policy=class_name, cache_policy_module_path=MODULE)
    policy = m._policy
    assert isinstance(policy, KVOffloadVLLMPolicy)
    announced = 0
    out = []
    for i, keys in enumerate(trace):
        if times is not None:
            while announced < len(trace) and times[announced] <= times[i] + lookahead_ms:
                if trace[announced]:
                    policy.hint_queued(str(announced), trace[announced])
                announced += 1
        ctx = ReqContext(req_id=str(i))
        for j, key in enumerate(keys):
            ctx.set_offload_key_position(key, (j + 1) * TOKENS)
        m.on_new_request(ctx)
        hit = 0
        for key in keys:
            if m.lookup(key, ctx) is not LookupResult.HIT:
                break
            hit += 1
        if hit:
            m.prepare_load(keys[:hit], ctx)
            m.complete_load(keys[:hit], ctx)
        if times is not None:
            policy.hint_dequeued(str(i))
        rest = list(keys[hit:])
        if rest:
            stored = m.prepare_store(rest, ctx)
            if stored is not None and stored.keys_to_store:
                m.complete_store(stored.keys_to_store, ctx)
        m.on_request_finished(ctx)
        out.append(hit)
    return out


def kvoffload_hits(trace: Sequence[Sequence[OffloadKey]], policy: str, capacity: int) -> int:
    # vLLM's CachePolicy cannot decline a store: compare with the replay that offers all.
    return kvoffload_replay(trace, policy, capacity, admission=False).hit_blocks


def test_every_policy_has_a_class_the_factory_loads() -> None:
    for policy in policy_names():
        name = policy_class_name(policy)
        cls = CachePolicyFactory.get_cache_policy_cls(name, MODULE)
        assert issubclass(cls, CachePolicy) and cls.policy == policy  # type: ignore[attr-defined]
        assert getattr(kv_vllm, name) is cls
    assert kv_vllm.KVOffloadPolicy.policy == DEFAULT_CACHE_POLICY
    assert policy_class_name("chain_arms") == "KVOffloadChainArmsPolicy"
    assert policy_class_name("lru") == "KVOffloadLRUPolicy"


TRACES = {kind: trace_keys(generate(kind, 300, seed=3)) for kind in ("mixed", "loop", "chat")}
#: Capacities (fractions of a trace's unique blocks) where the policies differ and hit.
FRACTIONS = {"mixed": (0.02, 0.1), "chat": (0.05, 0.25), "loop": (0.5, 0.6)}


@pytest.mark.parametrize("kind", sorted(TRACES))
@pytest.mark.parametrize("policy", policy_names())
def test_same_hits_as_inside_kvoffload(kind: str, policy: str) -> None:
    trace = TRACES[kind]
    unique = len({k for keys in trace for k in keys})
    for frac in FRACTIONS[kind]:
        cap = max(4, int(unique * frac))
        ours = kvoffload_hits(trace, policy, cap)
        assert ours > 0 or kind == "loop"  # a loop twice the tier thrashes most policies to 0
        assert sum(vllm_replay(trace, policy_class_name(policy), cap)) == ours, (kind, cap)


STOCK = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize(
    "spec",
    [
        {},  # vLLM's default spec: CPUOffloadingSpec
        {"spec_name": "TieringOffloadingSpec", "secondary_tiers": []},
    ],
)
def test_vllm_specs_load_the_policy_by_name(tmp_path: Path, spec: dict[str, Any]) -> None:
    extra = {
        **spec,
        "cpu_bytes_to_use": 1 << 20,
        "eviction_policy": "KVOffloadChainArmsPolicy",
        "cache_policy_module_path": MODULE,
    }
    config = vllm_config(write_tiny_llama(tmp_path / "m"), 12, extra, connector=STOCK)
    with set_current_vllm_config(config):
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config(12)
        )
    manager = connector.connector_scheduler.manager
    cpu = getattr(manager, "primary_tier", manager)  # the tiering manager's CPU tier
    policy = cpu._policy
    assert type(policy).__name__ == "KVOffloadChainArmsPolicy"
    assert policy.inner.name == "chain_arms"
    connector.shutdown()


@pytest.mark.parametrize("policy", queue_aware_policies())
def test_same_hits_as_inside_kvoffload_with_queue_hints(policy: str) -> None:
    requests = generate("mixed", 300, seed=5)
    trace, times = trace_keys(requests), trace_times(requests)
    unique = len({k for keys in trace for k in keys})
    for frac in (0.02, 0.1):
        cap = max(4, int(unique * frac))
        for lookahead_ms in (500.0, 5000.0):
            ours = kvoffload_replay(
                trace, policy, cap, times, lookahead_ms, admission=False
            ).hit_blocks
            theirs = vllm_replay(trace, policy_class_name(policy), cap, times, lookahead_ms)
            assert sum(theirs) == ours, (cap, lookahead_ms)


@pytest.mark.parametrize("policy", policy_names())
def test_overlapping_jobs_keep_the_inner_policy_in_step(policy: str) -> None:
    """Loads and stores in flight across requests, failed stores, resets: no contract breach.

    After each request's finish the inner policy's residents are exactly the
    ready chunks and its evictable count is vLLM's own.
    """
    rng = random.Random(7)
    cap = 24
    m = CPUOffloadingManager(
        cap, cache_policy=policy_class_name(policy), cache_policy_module_path=MODULE
    )
    adapter = m._policy
    assert isinstance(adapter, KVOffloadVLLMPolicy)
    chains = [[bytes([c, j]) + bytes(6) for j in range(12)] for c in range(6)]
    loads: list[tuple[list[OffloadKey], ReqContext]] = []
    stores: list[tuple[list[OffloadKey], ReqContext]] = []
    for step in range(400):
        c = rng.randrange(len(chains))
        keys = [OffloadKey(k + bytes(4)) for k in chains[c][: rng.randint(1, 12)]]
        ctx = ReqContext(req_id=f"r{step}")
        for j, key in enumerate(keys):
            ctx.set_offload_key_position(key, (j + 1) * TOKENS)
        m.on_new_request(ctx)
        hit = 0
        while hit < len(keys) and m.lookup(keys[hit], ctx) is LookupResult.HIT:
            hit += 1
        if hit:
            m.prepare_load(keys[:hit], ctx)
            loads.append((keys[:hit], ctx))
        out = m.prepare_store(keys[hit:], ctx) if hit < len(keys) else None
        if out is not None and out.keys_to_store:
            stores.append((out.keys_to_store, ctx))
        # Settle some jobs out of order, a few stores failing.
        while loads and rng.random() < 0.6:
            done, lctx = loads.pop(rng.randrange(len(loads)))
            m.complete_load(done, lctx)
        while stores and rng.random() < 0.6:
            done, sctx = stores.pop(rng.randrange(len(stores)))
            m.complete_store(done, sctx, success=rng.random() > 0.1)
        m.on_request_finished(ctx)
        if rng.random() < 0.01:
            m.reset_cache()  # vLLM never completes jobs prepared before a reset
            loads.clear()
            stores.clear()
        ready = [k for k, ch in adapter._chunks.items() if ch.is_ready]
        assert len(adapter.inner) == len(ready)
        assert all(k in adapter.inner for k in ready)
        assert adapter.inner.num_evictable() == m._num_evictable_cache_chunks
