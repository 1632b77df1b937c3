"""The seeded multi-turn workload: determinism, growth per turn, sharing, hashing."""

from collections import Counter, defaultdict

import pytest

from kvoffload.engine.demo.workload import (
    TraceHasher,
    TraceRequest,
    WorkloadConfig,
    generate_trace,
    iter_prompts,
    request_block_hashes,
    zipf_cdf,
)
from kvoffload.hashing import hash_request_tokens, xxhash64

SMALL = WorkloadConfig(
    num_requests=300, num_conversations=20, system_prompt_tokens=64, max_context_tokens=1500, seed=3
)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = list(generate_trace(SMALL))
    assert a == list(generate_trace(SMALL))
    other = WorkloadConfig(**{**SMALL.__dict__, "seed": 4})
    assert [r.prompt_token_ids for r in generate_trace(other)] != [r.prompt_token_ids for r in a]
    assert len(a) == SMALL.num_requests


def test_each_turn_extends_the_previous_turn_of_its_conversation() -> None:
    last: dict[int, TraceRequest] = {}
    for req in generate_trace(SMALL):
        prev = last.get(req.conversation_id)
        if prev is None:
            assert req.turn == 0
        else:
            assert req.turn == prev.turn + 1
            history = prev.prompt_token_ids + prev.output_token_ids
            assert req.prompt_token_ids[: len(history)] == history
            assert len(req.prompt_token_ids) > len(history)
        last[req.conversation_id] = req


def test_lengths_and_vocab_within_bounds() -> None:
    cfg = SMALL
    for req in generate_trace(cfg):
        assert len(req.all_token_ids) <= cfg.max_context_tokens
        assert cfg.output_tokens[0] <= len(req.output_token_ids) <= cfg.output_tokens[1]
        assert all(0 <= t < cfg.vocab_size for t in req.all_token_ids)
        assert req.turn < cfg.turns[1]


def test_system_prompts_are_shared() -> None:
    trace = list(generate_trace(SMALL))
    first = {}
    for req in trace:
        first.setdefault(req.conversation_id, req)
    by_prompt = defaultdict(set)
    for req in first.values():
        by_prompt[req.system_prompt_id].add(tuple(req.prompt_token_ids[:64]))
    assert any(len(c) == 1 for c in by_prompt.values())  # same id, same tokens
    assert all(len(c) == 1 for c in by_prompt.values())
    users = Counter(r.system_prompt_id for r in first.values())
    assert max(users.values()) >= 2


def test_popularity_is_skewed() -> None:
    cfg = WorkloadConfig(
        num_requests=2000,
        num_conversations=50,
        zipf_s=1.2,
        system_prompt_tokens=16,
        turns=(1000, 1000),
        max_context_tokens=10**9,
    )
    counts = Counter(r.conversation_id for r in generate_trace(cfg))
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 5 * (sum(ranked) / cfg.num_conversations)
    cdf = zipf_cdf(4, 1.0)
    assert cdf[-1] == pytest.approx(1.0)
    assert cdf[0] == pytest.approx(1 / (1 + 1 / 2 + 1 / 3 + 1 / 4))


def test_conversations_end_and_slots_restart() -> None:
    trace = list(generate_trace(SMALL))
    convs = {r.conversation_id for r in trace}
    assert len(convs) > SMALL.num_conversations  # finished ones were replaced


def test_iter_prompts_yields_token_lists() -> None:
    prompts = list(iter_prompts(SMALL))
    assert prompts == [r.prompt_token_ids for r in generate_trace(SMALL)]
    assert all(isinstance(t, int) for t in prompts[0])


def test_trace_hasher_matches_hashing_from_scratch() -> None:
    hasher = TraceHasher(16)
    for req in generate_trace(SMALL):
        prompt, full = hasher.hashes(req)
        assert prompt == hash_request_tokens(req.prompt_token_ids, 16, xxhash64)
        assert full == request_block_hashes(req, 16, include_output=True)
        assert full[: len(prompt)] == prompt
        assert request_block_hashes(req.prompt_token_ids, 16) == prompt


def test_shared_system_prompt_gives_shared_block_hashes() -> None:
    firsts = {}
    for req in generate_trace(SMALL):
        if req.turn == 0:
            firsts.setdefault(req.system_prompt_id, []).append(req)
    group = next(g for g in firsts.values() if len(g) >= 2)
    a, b = (request_block_hashes(r, 16) for r in group[:2])
    assert a[:4] == b[:4]  # 64 shared tokens = 4 blocks
    assert a[4:5] != b[4:5]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_requests": 0},
        {"num_conversations": 0},
        {"user_tokens": (0, 4)},
        {"output_tokens": (5, 4)},
        {"max_context_tokens": 10},
        {"zipf_s": -1.0},
    ],
)
def test_bad_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**kwargs)


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        TraceHasher(0)


def test_continuing_turns_are_all_but_each_conversations_last() -> None:
    from kvoffload.engine.demo.workload import continuing_request_ids

    trace = list(generate_trace(WorkloadConfig(num_requests=200, seed=3)))
    cont = continuing_request_ids(trace)
    turns: dict[int, list[str]] = defaultdict(list)
    for r in trace:
        turns[r.conversation_id].append(r.req_id)
    assert cont == {i for ids in turns.values() for i in ids[:-1]}
    assert any(len(ids) > 1 for ids in turns.values()) and len(cont) < len(trace)
    assert continuing_request_ids([]) == set()
