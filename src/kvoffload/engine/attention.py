"""Paged attention over a block-table KV cache, batch-invariant by construction.

The KV cache of one layer is a pair ``(k_cache, v_cache)``, each shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` (``KVLayout.layer_kv``
views: any strides, blocks contiguous). A step's batch is flattened: the new
tokens of all sequences are rows ``0..T-1``; ``AttentionMetadata`` says which
rows belong to which sequence, how long each sequence is after this step,
which blocks hold it and the slot each new token's K/V is written to.

Batch invariance (why the kernel looks the way it does)
------------------------------------------------------
The engine must produce bit-identical results for a token whatever else is in
its batch and however its prefix was chunked, so that KV computed in one step,
in another request's step, or copied back from a CPU tier are interchangeable.
CPU GEMM kernels pick their blocking (and so their summation order) from the
matrix shapes, and softmax reductions sum in an order that depends on the row
length. So:

* queries are cut into tiles of ``QUERY_TILE`` rows of one sequence (padded by
  repeating the last row), and every product is a batch of fixed-shape
  matrices: ``[group * QUERY_TILE, head_dim] @ [head_dim, block_size]`` for
  scores and ``[group * QUERY_TILE, block_size] @ [block_size, head_dim]`` for
  values, one per (tile, KV head, key block). The batch always holds at least
  two matrices: a single GEMM may be split across threads, a batch is split
  by matrix;
* the softmax max is exact in any order; exponentials are elementwise; sums
  over keys are done within a block (fixed length ``block_size``, fixed
  positions since blocks start at multiples of ``block_size``) and then
  across blocks with ``cumsum``, a sequential left-to-right scan. Blocks past
  a query's position contribute exact zeros, so how many key blocks a batch
  is padded to does not change any result.

Causality: a query at position ``p`` sees keys ``0..p``. The new tokens' K/V are
written into the cache (``write_kv``) before attention reads it, so a chunk
sees its own earlier tokens through the cache exactly like cached context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

QUERY_TILE = 16


def _as_long_tensor(value: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.tensor(list(value), dtype=torch.long)
    if t.dtype != torch.long:
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {t.dtype}")
        t = t.long()
    return t.cpu()


@dataclass
class TilePlan:
    """How a batch's query rows are cut into fixed-size tiles; shared by all layers.

    ``rows``/``positions`` are ``[num_tiles, QUERY_TILE]`` (padding repeats a
    tile's last row), ``valid`` is ``[num_tiles * QUERY_TILE]``, ``tables`` is
    ``[num_tiles, num_key_blocks]`` (block ids, padded with block 0: padding
    keys are always masked).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    tables: torch.Tensor
    block_size: int
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tiles(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_key_blocks(self) -> int:
        return int(self.tables.shape[1])

    def mask(self, group: int) -> torch.Tensor:
        """``[num_tiles, 1, num_key_blocks, group * QUERY_TILE, block_size]``, True = masked."""
        m = self._masks.get(group)
        if m is None:
            nb, bs = self.num_key_blocks, self.block_size
            key_pos = torch.arange(nb * bs, dtype=torch.long).view(1, nb, 1, bs)
            qpos = self.positions.repeat(1, group).view(self.num_tiles, 1, group * QUERY_TILE, 1)
            m = (key_pos > qpos).unsqueeze(1)
            self._masks[group] = m
        return m


@dataclass
class AttentionMetadata:
    """Per-step batch description for paged attention (CPU int64 tensors).

    For ``B`` sequences and ``T`` new tokens:

    * ``query_start_loc`` ``[B+1]``: sequence ``i``'s new tokens are rows
      ``query_start_loc[i]:query_start_loc[i+1]``; starts at 0, non-decreasing;
    * ``seq_lens`` ``[B]``: tokens whose KV is in the cache after this step
      (context + new), so new token ``j`` of sequence ``i`` has position
      ``seq_lens[i] - n_i + j``;
    * ``block_tables`` ``[B, max_blocks]``: block ids of each sequence in
      order, padded (padding is never read); row ``i`` covers
      ``ceil(seq_lens[i] / block_size)`` blocks;
    * ``slot_mapping`` ``[T]``: ``block_id * block_size + offset`` where each new
      token's K/V is written; it must agree with ``block_tables``.

    Build it with ``AttentionMetadata.build``, which validates all of this.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    positions: torch.Tensor  # derived: position of every new token, [T]
    _plan: TilePlan | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor | Sequence[int],
        seq_lens: torch.Tensor | Sequence[int],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        slot_mapping: torch.Tensor | Sequence[int],
        block_size: int,
    ) -> AttentionMetadata:
        """Validate and normalise; ``ValueError`` names the first inconsistency."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        qsl = _as_long_tensor(query_start_loc, "query_start_loc")
        lens = _as_long_tensor(seq_lens, "seq_lens")
        slots = _as_long_tensor(slot_mapping, "slot_mapping")
        if qsl.dim() != 1 or qsl.numel() < 1 or int(qsl[0]) != 0:
            raise ValueError("query_start_loc must be 1-D, start at 0 and have B+1 entries")
        num_seqs = qsl.numel() - 1
        if lens.shape != (num_seqs,):
            raise ValueError(f"seq_lens has shape {tuple(lens.shape)}, expected ({num_seqs},)")
        counts = qsl[1:] - qsl[:-1]
        if bool((counts < 0).any()):
            raise ValueError("query_start_loc must be non-decreasing")
        if bool((lens < counts).any()):
            raise ValueError("seq_lens must be >= the number of new tokens of each sequence")
        num_tokens = int(qsl[-1])
        if slots.shape != (num_tokens,):
            raise ValueError(
                f"slot_mapping has shape {tuple(slots.shape)}, expected ({num_tokens},)"
            )

        if isinstance(block_tables, torch.Tensor):
            tables = _as_long_tensor(block_tables, "block_tables")
            if tables.dim() != 2 or tables.shape[0] != num_seqs:
                raise ValueError(
                    f"block_tables has shape {tuple(tables.shape)}, expected ({num_seqs}, n)"
                )
            table_lens = torch.full((num_seqs,), tables.shape[1], dtype=torch.long)
        else:
            rows = [list(r) for r in block_tables]
            if len(rows) != num_seqs:
                raise ValueError(f"block_tables has {len(rows)} rows, expected {num_seqs}")
            width = max((len(r) for r in rows), default=0)
            tables = torch.zeros((num_seqs, max(width, 1)), dtype=torch.long)
            for i, r in enumerate(rows):
                if r:
                    tables[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            table_lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
        needed = (lens + block_size - 1) // block_size
        short = (table_lens < needed).nonzero()
        if short.numel():
            i = int(short[0, 0])
            raise ValueError(
                f"sequence {i}: block table has {int(table_lens[i])} blocks, "
                f"{int(lens[i])} tokens need {int(needed[i])}"
            )
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), counts)
        positions = (
            torch.arange(num_tokens, dtype=torch.long)
            - qsl[:-1][seq_of_row]
            + (lens - counts)[seq_of_row]
        )
        if num_tokens:
            covered = needed.clamp(min=1)
            bad_table = (tables[:, :] < 0) & (
                torch.arange(tables.shape[1]).unsqueeze(0) < covered.unsqueeze(1)
            )
            if bool(bad_table.any()):
                raise ValueError("block_tables hold a negative block id")
            expected = (
                tables[seq_of_row, positions // block_size] * block_size + positions % block_size
            )
            mismatch = (expected != slots).nonzero()
            if mismatch.numel():
                t = int(mismatch[0, 0])
                raise ValueError(
                    f"slot_mapping[{t}] = {int(slots[t])} but token {t} (sequence "
                    f"{int(seq_of_row[t])}, position {int(positions[t])}) lives in slot "
                    f"{int(expected[t])} according to its block table"
                )
        return cls(qsl, lens, tables, slots, block_size, positions)

    @property
    def num_seqs(self) -> int:
        return int(self.query_start_loc.numel() - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's newest token (sequences with new tokens only)."""
        ends = self.query_start_loc[1:]
        has_new = ends > self.query_start_loc[:-1]
        return ends[has_new] - 1

    @property
    def plan(self) -> TilePlan:
        if self._plan is None:
            self._plan = _build_plan(self)
        return self._plan


def _build_plan(meta: AttentionMetadata) -> TilePlan:
    bs = meta.block_size
    starts = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    tile_seq: list[int] = []
    tile_first: list[int] = []  # first row of the tile
    tile_count: list[int] = []  # valid rows in the tile
    tile_first_pos: list[int] = []
    for i in range(meta.num_seqs):
        n = starts[i + 1] - starts[i]
        ctx = lens[i] - n
        for off in range(0, n, QUERY_TILE):
            tile_seq.append(i)
            tile_first.append(starts[i] + off)
            tile_count.append(min(QUERY_TILE, n - off))
            tile_first_pos.append(ctx + off)
    if len(tile_seq) == 1:
        # A lone GEMM may be threaded differently from a batch of them; a dummy
        # copy of the tile (all rows invalid) keeps every step on the batched path.
        tile_seq.append(tile_seq[0])
        tile_first.append(tile_first[0])
        tile_count.append(0)
        tile_first_pos.append(tile_first_pos[0])
    num_tiles = len(tile_seq)
    if num_tiles == 0:
        empty = torch.zeros((0, QUERY_TILE), dtype=torch.long)
        return TilePlan(empty, empty, torch.zeros(0, dtype=torch.bool), empty[:, :1], bs)
    seq = torch.tensor(tile_seq, dtype=torch.long)
    first = torch.tensor(tile_first, dtype=torch.long)
    count = torch.tensor(tile_count, dtype=torch.long)
    first_pos = torch.tensor(tile_first_pos, dtype=torch.long)
    j = torch.arange(QUERY_TILE, dtype=torch.long).unsqueeze(0)
    last = (count - 1).clamp(min=0).unsqueeze(1)
    offs = torch.minimum(j, last)
    rows = first.unsqueeze(1) + offs
    positions = first_pos.unsqueeze(1) + offs
    valid = (j < count.unsqueeze(1)).reshape(-1)
    blocks_needed = positions[:, -1] // bs + 1
    nb = int(blocks_needed.max())
    tables = meta.block_tables[seq][:, :nb] if meta.block_tables.shape[1] >= nb else None
    if tables is None:  # cannot happen after build()'s checks; keeps the plan total
        raise ValueError("block tables do not cover the batch's positions")
    col = torch.arange(nb, dtype=torch.long).unsqueeze(0)
    tables = torch.where(col < blocks_needed.unsqueeze(1), tables, torch.zeros_like(tables))
    return TilePlan(rows, positions, valid, tables.contiguous(), bs)


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


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T', H, D]`` (``T' >= T``; rows past ``T`` are
    ignored and come back zero) over each sequence's cached keys.

    The new tokens' K/V must already be in the cache (``write_kv``). Returns
    ``[T', H, D]``. Grouped-query heads: query head ``h`` reads KV head
    ``h // (H / H_kv)``, as HF's ``repeat_kv`` does.
    """
    plan = meta.plan
    num_rows, num_heads, head_dim = query.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    out = query.new_zeros((num_rows, num_heads, head_dim))
    if plan.num_tiles == 0:
        return out
    nt, nb, tile = plan.num_tiles, plan.num_key_blocks, QUERY_TILE
    gq = group * tile

    # [nt, tile, H, D] -> [nt, H_kv, 1, group*tile, D]; row r of a (tile, kv head) is
    # query head kv*group + r // tile at tile row r % tile.
    q = query[plan.rows].view(nt, tile, num_kv, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(nt, num_kv, 1, gq, head_dim)
    k = k_cache[plan.tables].permute(0, 3, 1, 4, 2)  # [nt, H_kv, nb, D, bs]
    v = v_cache[plan.tables].permute(0, 3, 1, 2, 4)  # [nt, H_kv, nb, bs, D]

    scores = torch.matmul(q.expand(nt, num_kv, nb, gq, head_dim), k)  # [nt, H_kv, nb, gq, bs]
    scores = scores * scale
    scores = scores.masked_fill(plan.mask(group), float("-inf"))
    row_max = scores.amax(dim=(2, 4), keepdim=True)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1).cumsum(dim=2)[:, :, -1]  # [nt, H_kv, gq]
    numer = torch.matmul(probs, v).cumsum(dim=2)[:, :, -1]  # [nt, H_kv, gq, D]
    o = numer / denom.unsqueeze(-1)
    o = o.view(nt, num_kv, group, tile, head_dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(nt * tile, num_heads, head_dim)
    out[plan.rows.reshape(-1)[plan.valid]] = o[plan.valid]
    return out
