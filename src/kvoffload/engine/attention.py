"""Paged attention over a block-table KV cache, batch-invariant by construction.

The KV cache of one layer is a pair ``(k_cache, v_cache)``, each shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` (``KVLayout.layer_kv``
views: any strides, blocks contiguous). A step's batch is flattened: the new
tokens of all sequences are rows ``0..T-1``; ``AttentionMetadata``
(``kvoffload.engine.attention_metadata``, with the tile plan) says which
rows belong to which sequence, how long each sequence is after this step,
which blocks hold it and the slot each new token's K/V is written to.

Batch invariance (why the kernel looks the way it does)
------------------------------------------------------
The engine must produce bit-identical results for a token whatever else is in
its batch and however its prefix was chunked, so that KV computed in one step,
in another request's step, or copied back from a CPU tier are interchangeable.
A GEMM's summation order depends on its shape and on where an element sits in
it (``kvoffload.engine.gemm``), so every GEMM here has a declared shape and
every query and key a place fixed by its position:

* a sequence's new queries are cut into tiles of ``QUERY_TILE`` aligned to
  positions ``[t * QUERY_TILE, (t + 1) * QUERY_TILE)``; query ``p`` with query
  head ``h`` is row ``(p % QUERY_TILE) * group + h % group`` of its tile (other
  rows are padding: zero queries whose results are dropped);
* keys are read in chunks of ``KEY_CHUNK`` positions ``[c * KEY_CHUNK, (c + 1)
  * KEY_CHUNK)``; key ``p`` is column (or, for values, summed row) ``p %
  KEY_CHUNK`` (slots past the sequence read block 0 and are masked);
* a tile attends to chunks ``0..c*``, where ``c*`` holds the tile itself
  (``QUERY_TILE`` divides ``KEY_CHUNK``). Per (tile, KV head, chunk) there are
  three GEMMs (``gemm.attention_shapes``): scores ``[QUERY_TILE * group, D] @
  [D, KEY_CHUNK]``, value sums ``[QUERY_TILE * group, KEY_CHUNK] @ [KEY_CHUNK,
  D]`` and softmax denominators (probabilities times a column of ones), all
  run by ``gemm.batched_mm`` in batches of the dtype's fixed size;
* the softmax max is exact in any order and ``exp`` is elementwise; only the
  tile's own chunk needs a causal mask, which depends only on the tile's
  offset in that chunk: hidden keys' scores are set to a huge negative number
  before the max and their probabilities to exactly 0 after ``exp`` (whose
  input is floored where its result would be subnormal: subnormals make
  ``exp`` an order of magnitude slower). So what unused slots hold never
  matters as long as it is finite (the cache starts zeroed and only ever
  receives computed or copied KV);
* each tile's per-chunk results are summed in chunk order ``0, 1, ..``,
  whatever else is in the step.

A query's output therefore depends only on its position, its own values and
its sequence's keys, under the one assumption ``kvoffload.engine.gemm``
states (a same-shape BLAS call computes each element the same way) and that
``exp``'s vector and scalar paths agree (``tests/engine/test_gemm_conformance``
checks both).

Causality: a query at position ``p`` sees keys ``0..p``. The new tokens' K/V are
written into the cache (``write_kv``) before attention reads it, so a chunk
sees its own earlier tokens through the cache exactly like cached context.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from kvoffload.engine import gemm
from kvoffload.engine.attention_metadata import AttentionMetadata, AttentionPlan
from kvoffload.engine.gemm import KEY_CHUNK, QUERY_TILE, attention_batch

__all__ = [
    "KEY_CHUNK",
    "QUERY_TILE",
    "AttentionMetadata",
    "AttentionPlan",
    "check_kv_cache",
    "paged_attention",
    "write_kv",
]


def _exp_floor(dtype: torch.dtype) -> float:
    """Smallest exp input whose result is a normal number of ``dtype`` (with margin)."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


@lru_cache(maxsize=16)
def _diagonal_mask(group: int) -> torch.Tensor:
    """``[KEY_CHUNK // QUERY_TILE, QUERY_TILE * group, KEY_CHUNK]``, True where hidden.

    Entry ``o`` is for a tile that starts ``o * QUERY_TILE`` keys into its own
    chunk: key row ``r`` is hidden from query slot ``j`` when ``r > o *
    QUERY_TILE + j``.
    """
    offsets = torch.arange(KEY_CHUNK // QUERY_TILE).view(-1, 1, 1)
    rows = torch.arange(KEY_CHUNK).view(1, 1, -1)
    slots = torch.arange(QUERY_TILE).repeat_interleave(group).view(1, -1, 1)
    return rows > offsets * QUERY_TILE + slots


def check_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    """``ValueError`` unless both caches are ``[num_blocks, block_size, H_kv, D]`` alike."""
    expected_tail = (block_size, num_kv_heads, head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[1:]) != expected_tail:
            raise ValueError(
                f"{name} has shape {tuple(c.shape)}, expected [num_blocks, {block_size}, "
                f"{num_kv_heads}, {head_dim}]"
            )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' ``key``/``value`` (``[T, H_kv, D]``) at their slots, in place."""
    if slot_mapping.numel() == 0:
        return
    bs = k_cache.shape[1]
    block = slot_mapping // bs
    offset = slot_mapping % bs
    if int(block.max()) >= k_cache.shape[0] or int(slot_mapping.min()) < 0:
        raise ValueError(f"slot_mapping points outside the cache ({k_cache.shape[0]} blocks)")
    # Two-index assignment writes through strided views (kv_split, cross_layer).
    k_cache[block, offset] = key.to(k_cache.dtype)
    v_cache[block, offset] = value.to(v_cache.dtype)


def _chunk_sum(parts: torch.Tensor, num_tiles: int, counts: list[int]) -> torch.Tensor:
    """Per tile, ``parts`` (items on dim 1, ``AttentionPlan`` order) summed over
    its chunks ``0, 1, ..`` left to right, its own chunk last."""
    if not counts:
        return parts[:, :num_tiles].clone()
    total = parts[:, num_tiles : num_tiles + counts[0]].clone()
    start = num_tiles + counts[0]
    for n in counts[1:]:
        total[:, :n] += parts[:, start : start + n]
        start += n
    total += parts[:, : counts[0]]
    return torch.cat([total, parts[:, counts[0] : num_tiles]], dim=1)


def _chunk_max(parts: torch.Tensor, num_tiles: int, counts: list[int]) -> torch.Tensor:
    """Per tile, the max of ``parts`` (items on dim 1) over its chunks (exact)."""
    total = parts[:, :num_tiles].clone()
    start = num_tiles
    for n in counts:
        torch.maximum(total[:, :n], parts[:, start : start + n], out=total[:, :n])
        start += n
    return total


def _gather_chunks(cache: torch.Tensor, plan: AttentionPlan, items: int) -> torch.Tensor:
    """The keys (or values) of every item, ``[items, KEY_CHUNK, H_kv, D]``; items
    past ``plan.num_items`` read block 0."""
    _, bs, num_kv, head_dim = cache.shape
    blocks, offsets = plan.padded_keys(items)
    slot_contiguous = cache.stride()[1:] == (num_kv * head_dim, head_dim, 1)
    if KEY_CHUNK % bs == 0 and slot_contiguous:
        # Whole blocks: each item's chunk is KEY_CHUNK / bs consecutive blocks.
        ids = blocks[:, ::bs].reshape(-1)
        rows = torch.index_select(cache.flatten(1), 0, ids)
    elif slot_contiguous and cache.stride(0) == bs * num_kv * head_dim:
        rows = torch.index_select(
            cache.view(-1, num_kv * head_dim), 0, (blocks * bs + offsets).view(-1)
        )
    else:
        rows = cache[blocks, offsets]
    return rows.view(items, KEY_CHUNK, num_kv, head_dim)


def _labels(
    plan: AttentionPlan, items: int, num_heads: int, num_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Observation labels per KV head: key positions ``[H_kv, items, KEY_CHUNK]``
    and queries ``position * num_heads + head`` ``[H_kv, items, QUERY_TILE * group]``
    (``-1`` for padding)."""
    group = num_heads // num_kv
    keys = torch.full((items, KEY_CHUNK), -1, dtype=torch.long)
    keys[: plan.num_items] = plan.key_positions
    pos = torch.full((items, QUERY_TILE), -1, dtype=torch.long)
    pos[: plan.num_items] = plan.tile_positions[plan.item_tiles]
    heads = torch.arange(num_heads).view(num_kv, 1, 1, group)
    q = torch.where(
        pos.view(1, items, QUERY_TILE, 1) >= 0,
        pos.view(1, items, QUERY_TILE, 1) * num_heads + heads,
        -1,
    )
    return keys.expand(num_kv, items, KEY_CHUNK), q.reshape(num_kv, items, -1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's cached keys.

    ``query`` is ``[R, H, D]``; token ``i`` of the step (``0 <= i < T``) is row
    ``token_rows[i]`` (default: row ``i``, ``R >= T``). Returns ``[R, H, D]``
    with each token's output in its row and zeros in the other rows. The new
    tokens' K/V must already be in the cache (``write_kv``). Grouped-query
    heads: query head ``h`` reads KV head ``h // (H / H_kv)``, as HF's
    ``repeat_kv`` does.
    """
    num_rows, num_heads, head_dim = query.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    plan = meta.plan
    out = query.new_zeros((num_rows, num_heads, head_dim))
    if plan.num_tiles == 0:
        return out
    dtype = query.dtype
    cols = QUERY_TILE * group
    n_tiles, n_items, counts = plan.num_tiles, plan.num_items, plan.chunk_counts
    batch = attention_batch(dtype)
    items = -(-n_items // batch) * batch

    # Query tiles, [C, D] per KV head: row = slot * group + g; padding slots
    # read an appended zero row. One copy per item (tiles repeat over chunks).
    if token_rows is None:
        rows = plan.tile_rows
    else:
        rows = torch.cat([token_rows.long(), torch.tensor([num_rows])])[plan.tile_rows]
    q = torch.cat([query, query.new_zeros((1, num_heads, head_dim))])[rows] * scale
    q = q.view(n_tiles, QUERY_TILE, num_kv, group, head_dim).transpose(1, 2)
    q = q.reshape(n_tiles, num_kv, cols, head_dim)
    q_items = torch.index_select(q, 0, plan.padded_tiles(items))
    keys = _gather_chunks(k_cache, plan, items)
    values = _gather_chunks(v_cache, plan, items)
    labels = _labels(plan, items, num_heads, num_kv) if gemm.observing() else None

    # Scores transposed, [C, KEY_CHUNK] per (KV head, item): keys on the inner
    # dimension make the max and the value GEMM's operand contiguous.
    scores = query.new_empty((num_kv, items, cols, KEY_CHUNK))
    for h in range(num_kv):
        gemm.batched_mm(
            q_items[:, h],
            keys[:, :, h].transpose(1, 2),
            scores[h],
            "attention.scores",
            None if labels is None else (labels[1][h], labels[0][h], None),
        )
    s = scores[:, :n_items]
    hidden = _diagonal_mask(group)[plan.tile_offsets]  # each tile's own chunk
    s[:, :n_tiles].masked_fill_(hidden, -0.5 * torch.finfo(dtype).max)
    top = _chunk_max(s.amax(dim=3), n_tiles, counts)  # [H_kv, NT, C]
    s.sub_(top.index_select(1, plan.item_tiles).unsqueeze(3))
    s.clamp_(min=_exp_floor(dtype)).exp_()
    s[:, :n_tiles].masked_fill_(hidden, 0)

    sums = query.new_empty((num_kv, items, cols, head_dim))
    dens = query.new_empty((num_kv, items, cols, 1))
    ones = query.new_ones((1, KEY_CHUNK, 1)).expand(items, KEY_CHUNK, 1)
    for h in range(num_kv):
        labels_h = None if labels is None else (labels[1][h], None, labels[0][h])
        gemm.batched_mm(scores[h], values[:, :, h], sums[h], "attention.values", labels_h)
        gemm.batched_mm(scores[h], ones, dens[h], "attention.denominators", labels_h)
    o = _chunk_sum(sums, n_tiles, counts) / _chunk_sum(dens, n_tiles, counts)
    o = o.view(num_kv, n_tiles, QUERY_TILE, group, head_dim).permute(1, 2, 0, 3, 4)
    o = o.reshape(n_tiles * QUERY_TILE, num_heads, head_dim)
    valid = (plan.tile_positions >= 0).reshape(-1)
    out[rows.reshape(-1)[valid]] = o[valid]
    return out
