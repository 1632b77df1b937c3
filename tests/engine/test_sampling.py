"""Greedy and seeded sampling: exact greedy, reproducible per request, right distribution."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvoffload.engine.sampling import filtered_probs, greedy, make_generator, sample


@dataclass
class Opts:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 3.0, 0.0, float("-inf"), 2.0])


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    assert greedy(LOGITS) == 1
    assert sample(LOGITS, Opts(temperature=0.0)) == 1
    assert sample(LOGITS, Opts(temperature=0.0, top_k=3), make_generator(0)) == 1
    assert greedy(torch.tensor([0.0, 0.0, 0.0])) == 0


def test_same_seed_same_tokens_different_seed_different() -> None:
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    opts = Opts(temperature=1.0)

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(logits, opts, gen) for _ in range(40)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_requests_interleaved_match_requests_alone() -> None:
    """Batching order does not matter: each request's stream depends on its own seed."""
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randn(100, generator=gen) for _ in range(30)]
    opts = Opts(temperature=0.8, top_p=0.9)
    alone = {}
    for seed in (1, 2, 3):
        g = make_generator(seed)
        alone[seed] = [sample(r, opts, g) for r in rows]
    gens = {seed: make_generator(seed) for seed in (1, 2, 3)}
    mixed: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for r in rows:
        for seed in (3, 1, 2):
            mixed[seed].append(sample(r, opts, gens[seed]))
    assert mixed == alone


def test_one_draw_per_sample_whatever_the_vocabulary() -> None:
    for vocab in (2, 50, 5000):
        gen, ref = make_generator(3), make_generator(3)
        for _ in range(5):
            sample(torch.randn(vocab), Opts(top_k=7, top_p=0.5), gen)
            torch.rand((), generator=ref, dtype=torch.float64)
        assert torch.equal(gen.get_state(), ref.get_state())


def test_empirical_distribution_matches_softmax() -> None:
    logits = torch.tensor([0.5, 1.5, -0.3, 1.0, 0.0])
    for temperature in (1.0, 0.5):
        gen = make_generator(11)
        n = 20000
        counts = torch.zeros(5)
        for _ in range(n):
            counts[sample(logits, Opts(temperature=temperature), gen)] += 1
        expected = torch.softmax(logits.double() / temperature, 0).float()
        assert (counts / n - expected).abs().max() < 0.015


def test_top_k_and_top_p_restrict_the_support() -> None:
    gen = make_generator(0)
    top3 = {sample(LOGITS, Opts(temperature=5.0, top_k=3), gen) for _ in range(300)}
    assert top3 == {1, 4, 2}  # the three best: 3.0, 3.0 (ids 1, 4), then 2.5
    assert {sample(LOGITS, Opts(top_k=1), gen) for _ in range(50)} == {1}
    assert {sample(LOGITS, Opts(top_p=1e-6), gen) for _ in range(50)} == {1}
    seen = {sample(LOGITS, Opts(temperature=50.0), gen) for _ in range(3000)}
    assert 6 not in seen and len(seen) == 7  # -inf is never drawn


def test_filtered_probs() -> None:
    ids, probs = filtered_probs(LOGITS, temperature=1.0)
    assert ids.tolist()[:3] == [1, 4, 2] and ids.tolist()[-1] == 6
    assert float(probs[-1]) == 0.0
    torch.testing.assert_close(float(probs.sum()), 1.0)
    ids, probs = filtered_probs(LOGITS, temperature=0.5, top_k=4)
    expected = torch.softmax(torch.tensor([3.0, 3.0, 2.5, 2.0], dtype=torch.float64) / 0.5, 0)
    assert ids.tolist() == [1, 4, 2, 7]
    torch.testing.assert_close(probs, expected)
    # top_p keeps the shortest prefix whose mass reaches p.
    ids, probs = filtered_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.8)
    assert ids.tolist() == [0, 1]
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375], dtype=torch.float64))
    ids, _ = filtered_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.81)
    assert ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sample(LOGITS, Opts(temperature=1.0)), "Generator"),
        (lambda: sample(LOGITS, Opts(temperature=-1.0)), "temperature"),
        (lambda: sample(LOGITS, Opts(top_k=-2), make_generator(0)), "top_k"),
        (lambda: sample(LOGITS, Opts(top_p=0.0), make_generator(0)), "top_p"),
        (lambda: sample(LOGITS.view(2, 4), Opts(temperature=0.0)), "one non-empty row"),
        (lambda: greedy(torch.tensor([])), "one non-empty row"),
        (
            lambda: sample(torch.full((3,), float("-inf")), Opts(), make_generator(0)),
            "no finite",
        ),
        (lambda: filtered_probs(LOGITS, 0.0), "temperature > 0"),
    ],
)
def test_invalid_input(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_works_with_the_engines_sampling_params() -> None:
    from kvoffload.engine.request import SamplingParams

    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4)
    gen = make_generator(params.seed or 0)
    token = sample(LOGITS, params, gen)
    assert token in {1, 4, 2, 7, 0}
