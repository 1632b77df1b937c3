"""What a step's batch looks like to paged attention, and where its GEMMs read.

:class:`AttentionMetadata` describes the batch (which rows belong to which
sequence, its block table, the slot each new token's K/V goes to), validated
once per step; its :attr:`~AttentionMetadata.plan` lays the step's queries
and keys out in the fixed tiles and chunks that ``kvoffload.engine.attention``
runs its batch-invariant GEMMs over (the why is in that module's docstring).
Everything here is CPU int64 index arithmetic: no KV is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvoffload.engine.gemm import KEY_CHUNK, QUERY_TILE

__all__ = ["AttentionMetadata", "AttentionPlan"]


def _as_long_tensor(value: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.tensor(list(value), dtype=torch.long)
    if t.dtype != torch.long:
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {t.dtype}")
        t = t.long()
    return t.cpu()


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
    _plan: AttentionPlan | None = field(default=None, repr=False)

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
    def plan(self) -> AttentionPlan:
        """The step laid out for attention's GEMMs (computed once; every layer shares it)."""
        if self._plan is None:
            self._plan = _build_plan(self)
        return self._plan


@dataclass
class AttentionPlan:
    """A step's queries and keys placed in attention's GEMM tiles (CPU int64).

    Tiles are sorted by their number of key chunks, most first. *Items* (one
    per tile and chunk) come in this order: first each tile's own chunk (its
    last; items ``0..NT-1`` are tiles ``0..NT-1``), then chunk by chunk the
    earlier ones: the items of chunk ``c`` are ``chunk_counts[c]`` consecutive
    entries for tiles ``0..chunk_counts[c] - 1``. So the causal mask touches
    one contiguous block, and summing a tile's chunks in order is a loop over
    ``c`` on prefixes.

    * ``tile_rows`` ``[NT, QUERY_TILE]``: the token (row of the step) in each
      query slot, ``num_tokens`` for padding; ``tile_positions`` its position
      (``-1`` for padding); ``tile_offsets`` ``[NT]``: the tile's offset in its
      own chunk, in tiles;
    * ``item_tiles`` ``[NI]``: each item's tile; ``key_blocks``,
      ``key_offsets``, ``key_positions`` ``[NI, KEY_CHUNK]``: where each key
      slot is read from (block 0, offset 0 past the sequence) and its position
      (``-1`` past the sequence).
    """

    num_tokens: int
    tile_rows: torch.Tensor
    tile_positions: torch.Tensor
    chunk_counts: list[int]
    item_tiles: torch.Tensor
    key_blocks: torch.Tensor
    key_offsets: torch.Tensor
    key_positions: torch.Tensor
    tile_offsets: torch.Tensor
    _padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_tiles(self) -> int:
        return int(self.tile_rows.shape[0])

    @property
    def num_items(self) -> int:
        return int(self.item_tiles.shape[0])

    @property
    def max_block(self) -> int:
        """The largest block id attention reads (0 when it reads none)."""
        return int(self.key_blocks.max()) if self.key_blocks.numel() else 0

    def padded_tiles(self, items: int) -> torch.Tensor:
        """``item_tiles`` padded with tile 0 to ``items`` entries."""
        pad = items - self.num_items
        return torch.cat([self.item_tiles, torch.zeros(pad, dtype=torch.long)])

    def padded_keys(self, items: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_blocks, key_offsets)`` padded with block 0, offset 0 to ``items`` rows."""
        cached = self._padded.get(items)
        if cached is None:
            fill = torch.zeros((items - self.num_items, KEY_CHUNK), dtype=torch.long)
            cached = (torch.cat([self.key_blocks, fill]), torch.cat([self.key_offsets, fill]))
            self._padded[items] = cached
        return cached


def _build_plan(meta: AttentionMetadata) -> AttentionPlan:
    qt, kc, bs = QUERY_TILE, KEY_CHUNK, meta.block_size
    qsl, lens = meta.query_start_loc, meta.seq_lens
    counts = qsl[1:] - qsl[:-1]
    seqs = (counts > 0).nonzero().flatten()
    first = (lens - counts)[seqs]  # first new position of each sequence
    end = lens[seqs]
    t0 = first // qt
    per_seq = (end - 1) // qt - t0 + 1
    owner = torch.repeat_interleave(torch.arange(seqs.numel()), per_seq)
    num_tiles = owner.numel()
    tile_start = torch.cumsum(per_seq, 0) - per_seq
    tile = t0[owner] + torch.arange(num_tiles) - tile_start[owner]
    last_chunk = tile * qt // kc
    order = torch.sort(-last_chunk, stable=True).indices
    owner, tile, last_chunk = owner[order], tile[order], last_chunk[order]

    positions = tile.unsqueeze(1) * qt + torch.arange(qt).unsqueeze(0)
    lo, hi = first[owner].unsqueeze(1), end[owner].unsqueeze(1)
    valid = (positions >= lo) & (positions < hi)
    tile_rows = torch.where(valid, qsl[seqs][owner].unsqueeze(1) + positions - lo, meta.num_tokens)
    tile_positions = torch.where(valid, positions, -1)

    # Earlier chunks: chunk c for every tile whose own chunk is past c.
    num_chunks = int(last_chunk[0]) if num_tiles else 0
    per_chunk = torch.bincount(last_chunk, minlength=num_chunks + 1)[1:].flip(0).cumsum(0).flip(0)
    chunk_counts = per_chunk.tolist()
    earlier = torch.repeat_interleave(torch.arange(num_chunks), per_chunk)
    start = torch.cumsum(per_chunk, 0) - per_chunk
    item_chunk = torch.cat([last_chunk, earlier])
    item_tiles = torch.cat(
        [torch.arange(num_tiles), torch.arange(earlier.numel()) - start[earlier]]
    )

    seq = seqs[owner][item_tiles]
    key_pos = item_chunk.unsqueeze(1) * kc + torch.arange(kc).unsqueeze(0)
    has_key = key_pos < lens[seq].unsqueeze(1)
    col = (key_pos // bs).clamp(max=meta.block_tables.shape[1] - 1)
    blocks = torch.where(has_key, meta.block_tables[seq.unsqueeze(1), col], 0)
    return AttentionPlan(
        num_tokens=meta.num_tokens,
        tile_rows=tile_rows,
        tile_positions=tile_positions,
        chunk_counts=chunk_counts,
        item_tiles=item_tiles,
        key_blocks=blocks,
        key_offsets=torch.where(has_key, key_pos % bs, 0),
        key_positions=torch.where(has_key, key_pos, -1),
        tile_offsets=tile * qt % kc // qt,
    )
