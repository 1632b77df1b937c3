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
Softmax reductions normally sum in an order that depends on the row length,
and GEMM kernels are chosen from the matrix shapes. So:

* each sequence's new tokens are cut into pieces of at most ``QUERY_PIECE``
  queries; pieces are grouped in buckets by their query count (rounded up to
  a power of two, at least 2) and key count (rounded up to a multiple of
  ``KEY_CHUNK``). Padding query columns repeat a real query and are dropped;
  padding keys are masked;
* scores are one GEMM per (piece, KV head) with the keys as rows:
  ``[keys, head_dim] @ [head_dim, queries * group]``. For attention's small
  inner dimension (head_dim <= 256) CPU GEMMs give each element the same
  value for any number of rows that is a multiple of 16 and any number of
  columns >= 2 (``tests/engine/test_attention.py`` checks it);
* the softmax max is exact in any order and exponentials are elementwise;
  numerator and denominator come from one fixed-shape GEMM per chunk of
  ``KEY_CHUNK`` keys (positions ``[c * KEY_CHUNK, (c + 1) * KEY_CHUNK)``),
  ``[head_dim + 1, KEY_CHUNK] @ [KEY_CHUNK, queries * group]`` (a row of ones
  appended to V gives the denominator), summed over chunks left to right.
  Chunks past a query's position contribute exact zeros, so the padding never
  changes a result. Hidden keys' probabilities are set to exactly 0 after
  ``exp`` (whose input is floored where its result would be subnormal:
  subnormals make ``exp`` an order of magnitude slower), so what a block's
  unused slots hold never matters as long as it is finite (the cache starts
  zeroed and only ever receives computed or copied KV).

Causality: a query at position ``p`` sees keys ``0..p``. The new tokens' K/V are
written into the cache (``write_kv``) before attention reads it, so a chunk
sees its own earlier tokens through the cache exactly like cached context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Keys per value GEMM; the key rows of every score GEMM are a multiple of it
# (see the module docstring).
KEY_CHUNK = 64
# Queries of one sequence attended together at most: a long prefill is split
# so that early queries do not pay for keys they cannot see.
QUERY_PIECE = 64
# Pieces with at most this many queries share a bucket whatever their key
# count (decode: fewer, larger batches beat tighter key padding).
SMALL_PIECE = 8


def _as_long_tensor(value: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.tensor(list(value), dtype=torch.long)
    if t.dtype != torch.long:
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {t.dtype}")
        t = t.long()
    return t.cpu()


def _exp_floor(dtype: torch.dtype) -> float:
    """Smallest exp input whose result is a normal number of ``dtype`` (with margin)."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass
class Bucket:
    """Query pieces attended together.

    ``rows``/``positions`` are ``[num_pieces, queries]`` (padding repeats a
    piece's last query), ``valid`` is ``[num_pieces * queries]``, ``tables``
    ``[num_pieces, num_blocks]`` holds the block ids covering the first
    ``num_keys`` key positions (padding reads block 0 and is masked).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    tables: torch.Tensor
    num_keys: int
    _masks: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @property
    def num_pieces(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.rows.shape[1])

    def masks(self, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bias, keep)``, each ``[num_pieces, 1, num_keys, queries * group]``.

        ``bias`` is 0 where the query column may see the key row and a huge
        negative number where not (adding it keeps hidden keys out of the
        max); ``keep`` is 1 and 0 likewise (multiplying by it makes hidden
        keys' probabilities exactly 0).
        """
        cached = self._masks.get((group, dtype))
        if cached is None:
            key_pos = torch.arange(self.num_keys, dtype=torch.long).view(1, -1, 1)
            # Columns are (query, head-in-group) pairs, query-major.
            qpos = self.positions.repeat_interleave(group, dim=1).unsqueeze(1)
            hidden = (key_pos > qpos).unsqueeze(1)
            bias = torch.zeros(hidden.shape, dtype=dtype)
            bias.masked_fill_(hidden, -0.5 * torch.finfo(dtype).max)
            keep = (~hidden).to(dtype)
            cached = self._masks[(group, dtype)] = (bias, keep)
        return cached


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
    _buckets: list[Bucket] | None = field(default=None, repr=False)

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
    def buckets(self) -> list[Bucket]:
        """The batch grouped for attention (computed once; every layer shares it)."""
        if self._buckets is None:
            self._buckets = _build_buckets(self)
        return self._buckets


def _key_rows(num_keys: int) -> int:
    """The smallest multiple of ``KEY_CHUNK`` that covers ``num_keys``."""
    return KEY_CHUNK * -(-max(num_keys, 1) // KEY_CHUNK)


def _build_buckets(meta: AttentionMetadata) -> list[Bucket]:
    bs = meta.block_size
    starts = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    # piece: (first row, count, first position, sequence)
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for i in range(meta.num_seqs):
        n = starts[i + 1] - starts[i]
        ctx = lens[i] - n
        for off in range(0, n, QUERY_PIECE):
            count = min(QUERY_PIECE, n - off)
            width = max(2, _next_pow2(count))
            keys = _key_rows(ctx + off + count)
            groups.setdefault((width, 0 if width <= SMALL_PIECE else keys), []).append(
                (starts[i] + off, count, ctx + off, i)
            )
    buckets = []
    for (width, _), pieces in sorted(groups.items()):
        first, count, first_pos, seq = (torch.tensor(col, dtype=torch.long) for col in zip(*pieces))
        j = torch.arange(width, dtype=torch.long).unsqueeze(0)
        offs = torch.minimum(j, (count - 1).unsqueeze(1))
        rows = first.unsqueeze(1) + offs
        positions = first_pos.unsqueeze(1) + offs
        valid = (j < count.unsqueeze(1)).reshape(-1)
        num_keys = _key_rows(int((first_pos + count).max()))
        num_blocks = -(-num_keys // bs)
        needed = (first_pos + count + bs - 1) // bs  # blocks holding keys a piece sees
        tables = meta.block_tables[seq][:, :num_blocks]
        if tables.shape[1] < num_blocks:
            pad = torch.zeros((len(pieces), num_blocks - tables.shape[1]), dtype=torch.long)
            tables = torch.cat([tables, pad], dim=1)
        col = torch.arange(num_blocks, dtype=torch.long).unsqueeze(0)
        tables = torch.where(col < needed.unsqueeze(1), tables, torch.zeros_like(tables))
        buckets.append(Bucket(rows, positions, valid, tables.contiguous(), num_keys))
    return buckets


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
    num_rows, num_heads, head_dim = query.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    out = query.new_zeros((num_rows, num_heads, head_dim))
    # Blocks as rows of ``block_size * H_kv * D`` (a view: blocks are contiguous).
    k_rows = k_cache.flatten(1)
    v_rows = v_cache.flatten(1)
    for b in meta.buckets:
        npc, nq, keys = b.num_pieces, b.num_queries, b.num_keys
        cols, chunks = nq * group, keys // KEY_CHUNK
        flat_tables = b.tables.reshape(-1)
        # Queries as columns: [pieces * H_kv, D, nq * group], column = query * group + g.
        q = (query[b.rows] * scale).view(npc, nq, num_kv, group, head_dim)
        q = q.permute(0, 2, 4, 1, 3).reshape(npc * num_kv, head_dim, cols)
        # Keys as rows: [pieces * H_kv, keys, D].
        k = torch.index_select(k_rows, 0, flat_tables).view(npc, -1, num_kv, head_dim)
        k = k[:, :keys].transpose(1, 2).reshape(npc * num_kv, keys, head_dim)
        scores = torch.bmm(k, q).view(npc, num_kv, keys, cols)
        bias, keep = b.masks(group, scores.dtype)
        scores = scores + bias
        # exp is an order of magnitude slower on inputs whose results are
        # subnormal, so inputs are floored where the result is still normal;
        # hidden keys are then zeroed exactly by ``keep``.
        probs = (scores - scores.amax(dim=2, keepdim=True)).clamp_(min=_exp_floor(scores.dtype))
        probs = probs.exp_().mul_(keep)
        # V transposed per key chunk with a row of ones under it:
        # [pieces, H_kv, chunks, D + 1, KEY_CHUNK].
        v = torch.index_select(v_rows, 0, flat_tables).view(npc, -1, num_kv, head_dim)
        v = v[:, :keys].view(npc, chunks, KEY_CHUNK, num_kv, head_dim)
        v1 = v.new_empty((npc, num_kv, chunks, head_dim + 1, KEY_CHUNK))
        v1[:, :, :, :head_dim] = v.permute(0, 3, 1, 4, 2)
        v1[:, :, :, head_dim] = 1
        partial = torch.bmm(
            v1.view(npc * num_kv * chunks, head_dim + 1, KEY_CHUNK),
            probs.view(npc * num_kv * chunks, KEY_CHUNK, cols),
        ).view(npc, num_kv, chunks, head_dim + 1, cols)
        total = partial[:, :, 0].clone()
        for c in range(1, chunks):  # left to right: a fixed order for every query
            total += partial[:, :, c]
        o = total[:, :, :head_dim] / total[:, :, head_dim:]
        o = o.view(npc, num_kv, head_dim, nq, group).permute(0, 3, 1, 4, 2)
        o = o.reshape(npc * nq, num_heads, head_dim)
        out[b.rows.reshape(-1)[b.valid]] = o[b.valid]
    return out
