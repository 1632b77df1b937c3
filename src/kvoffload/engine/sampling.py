"""Greedy and seeded sampling of one token from one row of logits.

Reproducibility: a request that samples owns a ``torch.Generator``; each
sampled token consumes exactly one draw from it (inverse-CDF sampling), so a
request's tokens depend only on its own logits and seed, never on the batch,
on other requests or on the vocabulary size. Filtering and the CDF are
computed in float64 over candidates sorted by (logit descending, token id
ascending), a total order, so ties are broken the same way everywhere.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SamplingOptions(Protocol):
    """What ``sample`` reads (``kvoffload.engine.request.SamplingParams`` has it)."""

    temperature: float  # 0 = greedy
    top_k: int  # 0 = off
    top_p: float  # 1 = off


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``, for one request."""
    return torch.Generator(device="cpu").manual_seed(int(seed))


def greedy(logits: torch.Tensor) -> int:
    """The arg-max token; ties go to the lowest token id."""
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"expected one non-empty row of logits, got shape {tuple(logits.shape)}")
    return int(torch.argmax(logits))


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates and their probabilities after temperature, top-k and top-p.

    Returns ``(token_ids, probs)``, both in candidate order (descending logit,
    then ascending id), ``probs`` float64 summing to 1. Top-k keeps the ``k``
    best; top-p keeps the shortest prefix whose mass reaches ``top_p`` (at
    least one token).
    """
    _check_options(temperature, top_k, top_p)
    if temperature <= 0:
        raise ValueError("filtered_probs needs temperature > 0 (0 is greedy)")
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"expected one non-empty row of logits, got shape {tuple(logits.shape)}")
    scaled = logits.detach().to(torch.float64).cpu() / float(temperature)
    if not bool(torch.isfinite(scaled).any()):
        raise ValueError("logits have no finite entry")
    ids = torch.arange(scaled.numel())
    # Stable sort of ids by descending logit: ties keep ascending id order.
    order = torch.sort(scaled, descending=True, stable=True).indices
    ids, scaled = ids[order], scaled[order]
    if 0 < top_k < scaled.numel():
        ids, scaled = ids[:top_k], scaled[:top_k]
    probs = torch.softmax(scaled, dim=0)
    if top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=0) - probs
        keep = int((mass_before < top_p).sum().clamp(min=1))
        ids, probs = ids[:keep], probs[:keep]
        probs = probs / probs.sum()
    return ids, probs


def sample(
    logits: torch.Tensor, params: SamplingOptions, generator: torch.Generator | None = None
) -> int:
    """One token from ``logits`` ``[vocab]``: greedy when ``params.temperature == 0``,
    otherwise seeded sampling with ``generator`` (required: one draw per call)."""
    _check_options(params.temperature, params.top_k, params.top_p)
    if params.temperature == 0:
        return greedy(logits)
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs the request's torch.Generator")
    ids, probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    cdf = torch.cumsum(probs, dim=0)
    j = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True)[0])
    # u * total can round up to the total itself: fall back to the last candidate
    # with mass, never to a zero-probability one.
    if j >= ids.numel():
        j = int((probs > 0).nonzero()[-1, 0])
    return int(ids[j])


def _check_options(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
