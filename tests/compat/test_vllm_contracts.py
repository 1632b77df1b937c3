"""The four vLLM 0.33 contract points of issue 11, side by side with vLLM's own code.

1. Free queue order: vLLM's ``BlockPool`` and ours, driven by the same random
   requests (prefix hits, partial tail blocks, frees, resets), keep the same
   free queue, block for block.
2. ``complete_store`` accepts the keys given to ``prepare_store``: vLLM's
   ``CPUOffloadingManager`` and ours, driven alike, agree on what is stored,
   storing and announced.
3. ``reset_cache``: both forget everything (ours refuses while busy unless
   forced; forced, it is vLLM's reset).
4. The offloaded block that holds the last prompt token is loaded and only
   that token is recomputed: vLLM's ``_lookup_complete_chunks`` (the rule of
   its offloading connector, run on a minimal stand-in for the scheduler
   object) against our ``OffloadingConnectorScheduler``.
"""

from tests.vllm_required import need_vllm

need_vllm()

import random  # noqa: E402
import types  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler as VllmConnectorScheduler,
)
from vllm.v1.core import kv_cache_utils as vku  # noqa: E402
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key as vllm_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPUManager  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402

from kvoffload.blocks import BlockPool  # noqa: E402
from kvoffload.engine.connector import OffloadingConnectorScheduler  # noqa: E402
from kvoffload.hashing import get_hash_fn_by_name, hash_request_tokens, make_none_hash  # noqa: E402
from kvoffload.offload import CPUOffloadingManager, make_offload_key  # noqa: E402

BS = 4
_FN = "sha256"
_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    vku.init_none_hash(get_hash_fn_by_name(_FN))


def our_hashes(tokens: list[int]) -> list[bytes]:
    return hash_request_tokens(tokens, BS, get_hash_fn_by_name(_FN), parent=make_none_hash(_FN))


def vllm_request(req_id: str, tokens: list[int]) -> VllmRequest:
    return VllmRequest(
        req_id,
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=vku.get_request_block_hasher(BS, get_hash_fn_by_name(_FN)),
    )


def free_order(pool: object) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]  # type: ignore[attr-defined]


# -- 1. free queue order ----------------------------------------------------------


def test_freed_empty_block_goes_to_the_front_in_both() -> None:
    ours, theirs = BlockPool(8), VllmBlockPool(8, True, BS)
    tokens = list(range(2 * BS + 1))  # two full blocks and a partial tail
    hs = our_hashes(tokens)
    req = vllm_request("a", tokens)
    assert list(req.block_hashes) == hs
    a, b = ours.get_new_blocks(3), theirs.get_new_blocks(3)
    ours.cache_full_blocks(a, hs, 0, 2, BS, tokens)
    theirs.cache_full_blocks(req, b, 0, 2, BS, 0)
    ours.free_request_blocks(a)
    theirs.free_blocks(reversed(b))
    assert free_order(ours) == free_order(theirs) == [3, 4, 5, 6, 7, 2, 1]
    # the next allocation takes the empty block, evicting nothing
    assert [x.block_id for x in ours.get_new_blocks(1)] == [3]
    assert [x.block_id for x in theirs.get_new_blocks(1)] == [3]
    assert ours.get_cached_block(hs[1]) is not None and theirs.get_cached_block(hs[1], [0])


@_SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["new", "new", "finish", "reset"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=4 * BS + 2),
            st.integers(0, 100),
        ),
        max_size=30,
    )
)
def test_free_queue_matches_vllm_under_random_requests(ops) -> None:
    n = 12
    ours, theirs = BlockPool(n), VllmBlockPool(n, True, BS)
    running: list[tuple[list, list]] = []  # (our blocks, vLLM blocks), head first
    for i, (op, tokens, pick) in enumerate(ops):
        if op == "new":
            hs = our_hashes(tokens)
            req = vllm_request(f"r{i}", tokens)
            hit_o, hit_v = [], []
            for h in hs:
                bo, bv = ours.get_cached_block(h), theirs.get_cached_block(h, [0])
                assert (bo is None) == (bv is None)
                if bo is None:
                    break
                assert bo.block_id == bv[0].block_id  # type: ignore[index]
                hit_o.append(bo)
                hit_v.append(bv[0])  # type: ignore[index]
            need = -(-len(tokens) // BS) - len(hit_o)
            free_hits = sum(1 for b in hit_o if b.ref_cnt == 0)
            if need > ours.get_num_free_blocks() - free_hits:
                continue
            ours.touch(hit_o)
            theirs.touch(hit_v)
            new_o, new_v = ours.get_new_blocks(need), theirs.get_new_blocks(need)
            assert [b.block_id for b in new_o] == [b.block_id for b in new_v]
            bo_all, bv_all = hit_o + new_o, hit_v + new_v
            ours.cache_full_blocks(bo_all, hs, len(hit_o), len(hs), BS, tokens)
            theirs.cache_full_blocks(req, bv_all, len(hit_v), len(hs), BS, 0)
            running.append((bo_all, bv_all))
        elif op == "finish" and running:
            bo_all, bv_all = running.pop(pick % len(running))
            ours.free_request_blocks(bo_all)
            theirs.free_blocks(reversed(bv_all))
        elif op == "reset":
            assert ours.reset_prefix_cache() == theirs.reset_prefix_cache()
        assert free_order(ours) == free_order(theirs)
        assert ours.get_num_free_blocks() == theirs.get_num_free_blocks()


# -- 2 and 3. the CPU offloading manager -------------------------------------------


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"))


def test_offload_keys_are_laid_out_alike() -> None:
    h = b"\x01" * 32
    assert make_offload_key(h, 3) == vllm_offload_key(h, 3)


@_SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "complete", "load", "unload", "reset"]),
            st.lists(st.integers(0, 7), min_size=1, max_size=4),
            st.booleans(),
            st.integers(0, 100),
        ),
        max_size=40,
    )
)
def test_cpu_manager_matches_vllm(ops) -> None:
    """Room for every key (no eviction: the policies' victim choice is not the point)."""
    ctx = ReqContext("r")
    ours = CPUOffloadingManager(16, cache_policy="lru", enable_events=True)
    theirs = VllmCPUManager(16, cache_policy="lru", enable_events=True)
    stores: list[tuple[list[bytes], list[bytes]]] = []  # (given keys, keys_to_store)
    loads: list[list[bytes]] = []
    for op, ids, flag, pick in ops:
        ks = [key(i) for i in dict.fromkeys(ids)]
        if op == "store":
            o, t = ours.prepare_store(ks), theirs.prepare_store(ks, ctx)
            assert o is not None and t is not None
            assert o.keys_to_store == t.keys_to_store
            if o.keys_to_store:
                stores.append((ks, list(o.keys_to_store)))
        elif op == "complete" and stores:
            given_keys, to_store = stores.pop(pick % len(stores))
            done = given_keys if flag else to_store  # the very keys, or keys_to_store
            success = pick % 3 != 0
            ours.complete_store(done, success=success)
            theirs.complete_store(done, ctx, success=success)
        elif op == "load":
            ready = [k for k in ks if ours.is_stored(k)]
            if ready:
                ours.prepare_load(ready)
                theirs.prepare_load(ready, ctx)
                loads.append(ready)
        elif op == "unload" and loads:
            done = loads.pop(pick % len(loads))
            ours.complete_load(done)
            theirs.complete_load(done, ctx)
        elif op == "reset":
            # vLLM's manager reset is unconditional: ours forced is the same.
            assert ours.reset_cache(force=True)
            theirs.reset_cache()
            stores.clear()
            loads.clear()
        for i in range(8):
            k = key(i)
            expected = (
                LookupResult.HIT
                if ours.is_stored(k)
                else LookupResult.HIT_PENDING
                if ours.is_storing(k)
                else LookupResult.MISS
            )
            assert theirs.lookup(k, ctx) is expected
        ev_o = [(e.keys, e.removed) for e in ours.take_events() if not e.removed]
        ev_t = [(e.keys, e.removed) for e in theirs.take_events() if not e.removed]
        assert ev_o == ev_t  # the same keys announced stored, in the same order


def test_reset_empties_the_tier_in_both_ours_refuses_while_busy() -> None:
    ctx = ReqContext("r")
    ours = CPUOffloadingManager(4, cache_policy="lru", enable_events=True)
    theirs = VllmCPUManager(4, cache_policy="lru", enable_events=True)
    ks = [key(i) for i in range(4)]
    for m_prepare, m_complete in (
        (ours.prepare_store, ours.complete_store),
        (lambda k: theirs.prepare_store(k, ctx), lambda k: theirs.complete_store(k, ctx)),
    ):
        m_prepare(ks[:2])
        m_complete(ks[:2])
    ours.prepare_load(ks[:1])
    theirs.prepare_load(ks[:1], ctx)
    # A deliberate difference: vLLM's manager relies on its scheduler to fence
    # in-flight jobs; ours refuses on its own unless forced.
    assert ours.reset_cache() is False and ours.is_stored(ks[0])
    ours.complete_load(ks[:1])
    theirs.complete_load(ks[:1], ctx)
    ours.take_events()
    theirs.take_events()
    assert ours.reset_cache() is True
    theirs.reset_cache()
    for k in ks:
        assert not ours.is_stored(k) and theirs.lookup(k, ctx) is LookupResult.MISS
    # The whole capacity is free again in both: 4 new keys, nothing evicted.
    o, t = ours.prepare_store(ks), theirs.prepare_store(ks, ctx)
    assert o is not None and t is not None
    assert o.keys_to_store == t.keys_to_store == ks
    assert o.evicted_keys == t.evicted_keys == []
    # Ours announces what it forgot; vLLM's manager says nothing (its routers
    # keep stale CPU entries until those keys are evicted again).
    assert [e.removed for e in ours.take_events()] == [True]


# -- 4. the last prompt token --------------------------------------------------------


def vllm_hit_tokens(
    manager: VllmCPUManager,
    keys: list[bytes],
    tokens_per_chunk: int,
    computed: int,
    num_tokens: int,
) -> int:
    """vLLM's ``_lookup_complete_chunks`` on a stand-in scheduler (full attention, one group)."""
    group = SimpleNamespace(
        tokens_per_chunk=tokens_per_chunk,
        sliding_window_size_in_chunks=None,
        is_eagle_group=False,
        group_idx=0,
        load_window_size_in_chunks=lambda end: None,
    )
    fake = SimpleNamespace(
        config=SimpleNamespace(kv_group_configs=[group]),
        manager=manager,
        _lookup_groups=(0,),
        _sliding_window_groups=(),
        _mamba_align_size=None,
        _chunks_being_loaded=None,
        _events_tracker=SimpleNamespace(record_lookup=lambda *a, **k: None),
    )
    fake._maximal_prefix_lookup = types.MethodType(
        VllmConnectorScheduler._maximal_prefix_lookup, fake
    )
    req_status = SimpleNamespace(
        num_locally_computed_tokens=computed,
        req=SimpleNamespace(num_tokens=num_tokens, request_id="r"),
        max_load_tokens=None,
        group_states=[SimpleNamespace(offload_keys=keys, lookup_hit_end_chunk_idx=0)],
        req_context=ReqContext("r"),
    )
    hit = VllmConnectorScheduler._lookup_complete_chunks(fake, req_status)
    assert hit is not None
    return hit


@pytest.mark.parametrize("factor", [1, 2])
def test_last_prompt_token_rule_matches_vllm(factor: int) -> None:
    rng = random.Random(factor)
    chunk = BS * factor
    whole_prompt_hits = 0
    for trial in range(60):
        aligned = trial % 3 == 0  # the case in point: the tier holds the whole prompt
        num_tokens = rng.randint(1, 6) * chunk if aligned else rng.randint(2, 6 * chunk)
        tokens = [rng.randrange(1000) for _ in range(num_tokens)]
        hs = our_hashes(tokens)
        n_chunks = len(hs) // factor
        stored = n_chunks if aligned else rng.randint(0, n_chunks)
        computed = rng.randint(0, stored) * chunk if rng.random() < 0.5 else 0
        # GPU hits never cover the last prompt token (both engines stop one short).
        computed = min(computed, ((num_tokens - 1) // chunk) * chunk)

        pool = BlockPool(64)
        ours_m = CPUOffloadingManager(64, cache_policy="lru")
        conn = OffloadingConnectorScheduler(pool, ours_m, BS, block_size_factor=factor)
        keys = [conn._key(hs, j) for j in range(n_chunks)]
        out = ours_m.prepare_store(keys[:stored])
        assert out is not None
        ours_m.complete_store(out.keys_to_store)
        theirs_m = VllmCPUManager(64, cache_policy="lru")
        ctx = ReqContext("r")
        theirs_m.prepare_store(keys[:stored], ctx)
        theirs_m.complete_store(keys[:stored], ctx)

        # vLLM: load `hit` tokens; a hit that reaches num_tokens is taken back by one
        # token when the load lands (Scheduler._update_waiting_for_remote_kv).
        v_hit = vllm_hit_tokens(theirs_m, keys, chunk, computed, num_tokens)
        v_loaded_chunks = v_hit // chunk
        v_computed_after = computed + v_hit
        if v_computed_after == num_tokens:
            v_computed_after -= 1
            whole_prompt_hits += 1

        n = conn.get_num_new_matched_tokens(f"r{trial}", hs, computed, num_tokens)
        our_loaded_chunks = 0
        if n:
            gpu = pool.get_new_blocks(-(-(computed + n) // BS))
            conn.update_state_after_alloc(f"r{trial}", gpu, n)
            (load,) = conn.build_connector_meta().loads
            our_loaded_chunks = len(load.src.block_ids)
        ctx_info = (trial, num_tokens, stored, computed, v_hit, n)
        assert our_loaded_chunks == v_loaded_chunks, ctx_info
        if v_hit:
            assert computed + n == v_computed_after, ctx_info
        else:
            assert n == 0, ctx_info
    assert whole_prompt_hits >= 10
