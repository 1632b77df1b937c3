"""The reference model's only GEMM calls, each with a shape from a declared set.

Why this module exists
----------------------
A CPU BLAS chooses its kernel, and with it the order in which each dot
product is summed, from the shape of the call: MKL's generic path on AMD CPUs
picks it from the column count, and every BLAS gives the rows or columns at
the ragged edge of a matrix to tail kernels. A result therefore depends on how
many other rows or columns shared its call and where it sat. The model and
attention never leave that to chance:

* every GEMM goes through ``tile_mm`` (one 2-D ``torch.mm``) or
  ``batched_mm`` (one ``torch.bmm`` whose batch size is the declared batch of
  its dtype, ``attention_batch``), and the callers only use shapes from
  ``linear_shape`` / ``attention_shapes`` (``DecoderLM.gemm_shapes`` lists a
  model's whole set);
* the callers place each token at a slot fixed by its absolute position
  (``row_tiles`` for linear layers; attention's query tiles and key chunks),
  pad the other slots, and keep padding out of every real result.

What is left is one assumption: a BLAS call of a given shape, operand layout
and thread count computes element ``(i, j)`` from row ``i`` of ``a`` and
column ``j`` of ``b`` in the same way every time, whatever the rest of the
call holds, and a batched call (always of its declared batch size) does so
for every batch index.
``tests/engine/test_gemm_conformance.py`` checks exactly that for each
declared shape and prints the BLAS configuration when a platform breaks it;
``tests/engine/test_gemm_structure.py`` checks that the model keeps to the
declared shapes and placements under random schedules.

Observation
-----------
``observe(callback)`` reports every call (kind, shape, operands and, from the
callers, the token labels of the slots) to ``callback``; it is for tests. The
callers build labels only while something observes (``observing()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Rows of every linear-layer GEMM; a token sits at row ``position % ROW_TILE``.
# Small because decode tokens fill tiles sparsely; per row, 8-row tiles cost
# within ~10-30% of 16- or 32-row ones for this model's matrices (measured).
ROW_TILE = 8
# Queries per attention tile, aligned to positions ``[t * QUERY_TILE, (t + 1) *
# QUERY_TILE)``; a divisor of ``KEY_CHUNK`` so that a tile never straddles two
# key chunks. Decode uses one slot in ``QUERY_TILE``: 4 balances that waste
# against prefill's per-query cost (8 is ~20% cheaper per query, twice the
# waste).
QUERY_TILE = 4
# Keys per attention GEMM; key position ``p`` sits at slot ``p % KEY_CHUNK``.
KEY_CHUNK = 64


def attention_batch(dtype: torch.dtype) -> int:
    """The batch size of every attention ``bmm`` in ``dtype`` (padded when short).

    Fixed, because the batch size is part of the call's shape: MKL computes a
    batch of one with its plain GEMM and larger ones with its batched GEMM, and
    on an Intel CPU the ``[16, 64] @ [64, 1]`` denominators already differ
    between the two (``tests/engine/test_gemm_conformance.py`` prints such
    cases). Reduced-precision GEMMs go through oneDNN, whose per-call overhead
    wants larger batches.
    """
    return 16 if dtype in (torch.float32, torch.float64) else 64


class GemmShape(NamedTuple):
    """``op`` is "mm" (``[m, k] @ [k, n]``) or "bmm" (``batch`` of them)."""

    op: str
    batch: int
    m: int
    k: int
    n: int
    dtype: torch.dtype


@dataclass(frozen=True)
class GemmCall:
    """One observed call. Labels are ``-1`` for padding slots; see the callers.

    ``row_labels`` ``[batch, m]`` label output rows, ``col_labels`` ``[batch,
    n]`` output columns, ``inner_labels`` ``[batch, k]`` the summed dimension
    (``None`` where that dimension is a weight's or a head's, not tokens').
    """

    kind: str
    shape: GemmShape
    a: torch.Tensor
    b: torch.Tensor
    row_labels: torch.Tensor | None = None
    col_labels: torch.Tensor | None = None
    inner_labels: torch.Tensor | None = None


Observer = Callable[[GemmCall], None]
_observers: list[Observer] = []


def observing() -> bool:
    """Whether a caller should build labels for ``tile_mm``/``batched_mm``."""
    return bool(_observers)


@contextmanager
def observe(callback: Observer) -> Iterator[None]:
    """Report every GEMM made inside the block to ``callback`` (tests)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def linear_shape(rows: int, fan_in: int, fan_out: int, dtype: torch.dtype) -> GemmShape:
    return GemmShape("mm", 1, rows, fan_in, fan_out, dtype)


def attention_shapes(head_dim: int, group: int, dtype: torch.dtype) -> tuple[GemmShape, ...]:
    """``(scores, values, denominators)`` per (query tile, KV head, key chunk):
    ``[QUERY_TILE * group, D] @ [D, KEY_CHUNK]``, ``[QUERY_TILE * group,
    KEY_CHUNK] @ [KEY_CHUNK, D]`` and ``[QUERY_TILE * group, KEY_CHUNK] @
    [KEY_CHUNK, 1]`` (probabilities times ones: the softmax denominator),
    each batched by ``attention_batch``."""
    batch = attention_batch(dtype)
    cols = QUERY_TILE * group
    return (
        GemmShape("bmm", batch, cols, head_dim, KEY_CHUNK, dtype),
        GemmShape("bmm", batch, cols, KEY_CHUNK, head_dim, dtype),
        GemmShape("bmm", batch, cols, KEY_CHUNK, 1, dtype),
    )


def tile_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    kind: str,
    row_labels: torch.Tensor | None = None,
) -> None:
    """``out = a @ b`` as one 2-D GEMM (``out`` contiguous)."""
    if _observers:
        shape = GemmShape("mm", 1, a.shape[0], a.shape[1], b.shape[1], a.dtype)
        call = GemmCall(kind, shape, a, b, None if row_labels is None else row_labels.unsqueeze(0))
        for cb in list(_observers):
            cb(call)
    torch.mm(a, b, out=out)


def batched_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    kind: str,
    labels: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> None:
    """``out = a @ b`` as ``len(a) / attention_batch`` bmm calls of exactly
    ``attention_batch(dtype)`` items each (the caller pads ``a``, ``b`` and
    ``out`` to a multiple). ``labels`` are ``(rows, cols, inner)`` for the whole
    padded batch."""
    step = attention_batch(a.dtype)
    total = a.shape[0]
    if total % step:
        raise ValueError(f"batch of {total} is not a multiple of {step}")
    for s in range(0, total, step):
        e = s + step
        if _observers:
            shape = GemmShape("bmm", step, a.shape[1], a.shape[2], b.shape[2], a.dtype)
            rows, cols, inner = labels if labels is not None else (None, None, None)
            call = GemmCall(
                kind,
                shape,
                a[s:e],
                b[s:e],
                None if rows is None else rows[s:e],
                None if cols is None else cols[s:e],
                None if inner is None else inner[s:e],
            )
            for cb in list(_observers):
                cb(call)
        torch.bmm(a[s:e], b[s:e], out=out[s:e])


class RowTiles(NamedTuple):
    """Where each token's row sits in a stack of ``tile``-row GEMM tiles.

    ``rows[i]`` is token ``i``'s row in the ``num_tiles * tile`` stack; it is
    ``positions[i] % tile`` within its tile, so every token lands at the same
    row of a same-shape GEMM whatever else is in the step. ``positions`` of the
    stack's rows are in ``row_positions`` (``-1`` for padding rows).
    """

    tile: int
    num_tiles: int
    rows: torch.Tensor
    row_positions: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.tile * self.num_tiles


def row_tiles(positions: torch.Tensor, tile: int) -> RowTiles:
    """Pack tokens (any order, any sequences) into the fewest tiles: a tile's row
    ``r`` takes a token with ``position % tile == r``; at least one tile."""
    positions = positions.reshape(-1).long()
    n = positions.numel()
    slot = positions % tile
    # The k-th token of each residue (in input order) goes to tile k.
    order = torch.sort(slot, stable=True).indices
    counts = torch.bincount(slot, minlength=tile)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n, dtype=torch.long) - starts[slot[order]]
    num_tiles = max(1, int(counts.max())) if n else 1
    rows = rank * tile + slot
    row_positions = torch.full((num_tiles * tile,), -1, dtype=torch.long)
    row_positions[rows] = positions
    return RowTiles(tile, num_tiles, rows, row_positions)


def tiled_matmul(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    tiles: RowTiles,
    kind: str,
) -> torch.Tensor:
    """``x @ weight_t`` for ``x`` ``[tiles.num_rows, k]`` laid out by ``tiles``,
    one ``tile_mm`` per tile."""
    t = tiles.tile
    out = x.new_empty((x.shape[0], weight_t.shape[1]))
    labels = tiles.row_positions if _observers else None
    for s in range(0, x.shape[0], t):
        tile_mm(
            x[s : s + t],
            weight_t,
            out[s : s + t],
            kind,
            None if labels is None else labels[s : s + t],
        )
    return out
