"""The routing bench's routers and its Mooncake scaling, without engines."""

from __future__ import annotations

import json
from pathlib import Path

from kvoffload.bench.routing.indexer import TierOverlap
from kvoffload.bench.routing.routers import KVRouter, Load, RandomRouter, RoundRobinRouter
from kvoffload.bench.routing.workloads import mooncake_requests, shared_prefix_tokens


def test_kv_router_prefers_the_longest_cheapest_prefix() -> None:
    router = KVRouter()
    loads = [Load(), Load(), Load()]
    overlaps = {0: TierOverlap(64, 16, 64, 64), 1: TierOverlap(48, 48, 48, 48)}
    # 64 tokens from CPU (credit 16 + 0.8 * 48 = 54.4) beat 48 on the GPU (48).
    assert router.pick(96, overlaps, loads) == 0
    # A GPU hit beats the same length from disk.
    overlaps = {0: TierOverlap(64, 0, 0, 64), 1: TierOverlap(64, 64, 64, 64)}
    assert router.pick(96, overlaps, loads) == 1


def test_kv_router_balances_queued_prefill() -> None:
    router = KVRouter()
    overlaps = {0: TierOverlap(32, 32, 32, 32)}
    busy = [Load(requests=3, prefill_tokens=400), Load()]
    # The holder's queue (400 tokens) costs more than recomputing 32 tokens elsewhere.
    assert router.pick(96, overlaps, busy) == 1
    # Nothing held anywhere, equal loads: round robin among equals.
    picks = {router.pick(96, {}, [Load(), Load()]) for _ in range(4)}
    assert picks == {0, 1}


def test_round_robin_and_random_ignore_the_index() -> None:
    rr = RoundRobinRouter()
    loads = [Load()] * 3
    held = {2: TierOverlap(96, 96, 96, 96)}
    assert [rr.pick(96, held, loads) for _ in range(4)] == [0, 1, 2, 0]
    a, b = RandomRouter(seed=5), RandomRouter(seed=5)
    assert [a.pick(96, held, loads) for _ in range(8)] == [
        b.pick(96, held, loads) for _ in range(8)
    ]


def test_mooncake_ids_become_shared_token_blocks(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 40, "output_length": 99, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 40, "output_length": 2, "hash_ids": [1, 2, 7, 8, 9]},
        {"timestamp": 2, "input_length": 10, "output_length": 2, "hash_ids": []},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = mooncake_requests(trace, 10, block_size=4, vocab_size=50, max_blocks=4, start=0)
    assert [len(r.token_ids) for r in reqs] == [12, 16]  # the id-less request is skipped
    assert reqs[0].token_ids[:8] == reqs[1].token_ids[:8]  # ids 1, 2 shared
    assert reqs[0].token_ids[8:12] != reqs[1].token_ids[8:12]
    assert [r.max_tokens for r in reqs] == [8, 2]  # replies capped
    assert shared_prefix_tokens(reqs, 4) == 8
    # start=None takes the trace's tail.
    tail = mooncake_requests(trace, 2, block_size=4, vocab_size=50)
    assert [r.req_id for r in tail] == ["mc-1"]


def test_kv_router_follows_a_prefix_it_just_sent_before_the_indexer_knows_it() -> None:
    router = KVRouter(block_size=4)
    loads = [Load(), Load()]
    first = list(range(16))
    i = router.pick(len(first), {}, loads, first)
    router.sent(i, first)
    loads[i] = Load(requests=1, prefill_tokens=4)  # still computing: not indexed yet
    # The next turn extends the first: same instance, though the indexer has nothing.
    follow = first + [99] * 8
    assert router.pick(len(follow), {}, loads, follow) == i
    # An unrelated prompt goes to the idle instance.
    other = list(range(100, 124))
    assert router.pick(len(other), {}, loads, other) == 1 - i
