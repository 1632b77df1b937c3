"""Paged attention against a plain contiguous causal SDPA reference, and its invariances."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvoffload.engine import gemm
from kvoffload.engine.attention import (
    KEY_CHUNK,
    QUERY_TILE,
    AttentionMetadata,
    check_kv_cache,
    paged_attention,
    write_kv,
)
from kvoffload.transfer.layout import KVGeometry, KVLayout


class Batch:
    """Random sequences laid out in a paged cache with shuffled block ids.

    Each sequence is ``(context_len, new_len)``; its context K/V is already in
    the cache, its new tokens' K/V are written by ``run`` before attention.
    """

    def __init__(
        self,
        specs: list[tuple[int, int]],
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float64,
        layout: str = "layer_first",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.specs = specs
        self.bs = block_size
        self.dtype = dtype
        needed = sum(-(-(c + n) // block_size) for c, n in specs)
        num_blocks = needed + 3
        geo = KVGeometry(1, num_kv_heads, head_dim, block_size, dtype)
        self.tensors = KVLayout(geo, layout).allocate(num_blocks)
        self.k_cache, self.v_cache = KVLayout(geo, layout).layer_kv(self.tensors, 0)
        # Stale garbage everywhere, so reading an unwritten slot would show.
        self.k_cache.copy_(torch.randn(self.k_cache.shape, generator=gen, dtype=dtype))
        self.v_cache.copy_(torch.randn(self.v_cache.shape, generator=gen, dtype=dtype))
        ids = list(range(1, num_blocks))
        rng.shuffle(ids)
        self.tables: list[list[int]] = []
        self.keys: list[torch.Tensor] = []  # full K per sequence, [L, Hkv, D]
        self.values: list[torch.Tensor] = []
        self.queries: list[torch.Tensor] = []  # new tokens' queries, [n, H, D]
        for ctx, n in specs:
            length = ctx + n
            nb = -(-length // block_size)
            table = [ids.pop() for _ in range(nb)]
            self.tables.append(table)
            k = torch.randn((length, num_kv_heads, head_dim), generator=gen, dtype=dtype)
            v = torch.randn((length, num_kv_heads, head_dim), generator=gen, dtype=dtype)
            self.keys.append(k)
            self.values.append(v)
            self.queries.append(torch.randn((n, num_heads, head_dim), generator=gen, dtype=dtype))
            for p in range(ctx):  # the cached context
                self.k_cache[table[p // block_size], p % block_size] = k[p]
                self.v_cache[table[p // block_size], p % block_size] = v[p]
        self.scale = head_dim**-0.5

    def metadata(self) -> AttentionMetadata:
        starts, lens, slots = [0], [], []
        for (ctx, n), table in zip(self.specs, self.tables):
            starts.append(starts[-1] + n)
            lens.append(ctx + n)
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(ctx, ctx + n)]
        return AttentionMetadata.build(starts, lens, self.tables, slots, self.bs)

    def run(self, extra_rows: int = 0) -> torch.Tensor:
        meta = self.metadata()
        new_k = torch.cat([k[c:] for k, (c, _) in zip(self.keys, self.specs)])
        new_v = torch.cat([v[c:] for v, (c, _) in zip(self.values, self.specs)])
        write_kv(self.k_cache, self.v_cache, new_k, new_v, meta.slot_mapping)
        q = torch.cat(self.queries)
        if extra_rows:
            q = torch.cat([q, torch.randn((extra_rows, *q.shape[1:]), dtype=q.dtype)])
        out = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        assert out.shape == q.shape
        assert torch.count_nonzero(out[meta.num_tokens :]) == 0
        return out[: meta.num_tokens]

    def reference(self) -> torch.Tensor:
        """Contiguous causal SDPA per sequence, KV heads repeated as HF's repeat_kv."""
        outs = []
        for (ctx, n), q, k, v in zip(self.specs, self.queries, self.keys, self.values):
            if n == 0:
                continue
            group = q.shape[1] // k.shape[1]
            kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
            vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
            qq = q.transpose(0, 1)  # [H, n, D]
            q_pos = torch.arange(ctx, ctx + n).unsqueeze(1)
            allowed = torch.arange(ctx + n).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=self.scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


SPECS = [
    [(0, 1)],
    [(0, 37)],
    [(21, 1)],
    [(0, 40), (13, 1), (50, 7), (5, 0), (64, 16)],
    [(3, 2), (0, 17), (31, 33)],
    [(0, 2 * QUERY_TILE * 16 + 7), (100, QUERY_TILE * 16 + 1), (KEY_CHUNK - 1, 1)],
]


@pytest.mark.parametrize("specs", SPECS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 8), (8, 2, 32), (6, 1, 16)])
def test_matches_contiguous_sdpa(specs, block_size, heads, kv_heads, head_dim) -> None:
    b = Batch(specs, block_size, heads, kv_heads, head_dim, seed=len(specs) * block_size)
    torch.testing.assert_close(b.run(), b.reference(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["layer_first", "kv_split", "cross_layer"])
def test_strided_cache_views(layout) -> None:
    b = Batch([(9, 12), (0, 5)], 4, 4, 2, 8, layout=layout, seed=3)
    torch.testing.assert_close(b.run(), b.reference(), rtol=1e-10, atol=1e-10)
    # The writes landed in the layout's tensors, at the slots the table says.
    table = b.tables[0]
    for p in range(9, 21):
        assert torch.equal(b.k_cache[table[p // 4], p % 4], b.keys[0][p])


def test_float32_close_to_reference() -> None:
    b = Batch([(30, 20), (0, 33)], 16, 8, 2, 32, dtype=torch.float32, seed=5)
    torch.testing.assert_close(b.run(), b.reference(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_result_independent_of_batch_and_padding(dtype) -> None:
    """A sequence's output is bit-identical alone, with others, and with padded rows."""
    target = (19, 23)
    alone = Batch([target], 8, 8, 2, 32, dtype=dtype, seed=11).run()
    # Other sequences (one much longer, so key blocks are padded further) around it.
    for others in ([(0, 3)], [(100, 1), (0, 50)], [(5, 60), (7, 1), (0, 1)]):
        b = Batch([*others, target], 8, 8, 2, 32, dtype=dtype, seed=11)
        # Same target data whatever came before: regenerate it with the solo seed.
        solo = Batch([target], 8, 8, 2, 32, dtype=dtype, seed=11)
        i = len(others)
        b.queries[i], b.keys[i], b.values[i] = solo.queries[0], solo.keys[0], solo.values[0]
        table = b.tables[i]
        for p in range(target[0]):
            b.k_cache[table[p // 8], p % 8] = solo.keys[0][p]
            b.v_cache[table[p // 8], p % 8] = solo.values[0][p]
        out = b.run(extra_rows=5)
        start = sum(n for _, n in others)
        assert torch.equal(out[start : start + target[1]], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "pieces", [[7, 16, 1, 21], [1, 2, 1, 2, 3, 7, 29], [2, 64, 1, 3], [45, 1, 2, 37]]
)
def test_chunked_queries_equal_one_shot(dtype, pieces) -> None:
    """Queries computed in several chunks (earlier ones cached) equal one shot, bitwise."""
    total = sum(pieces)
    full = Batch([(0, total)], 8, 4, 2, 16, dtype=dtype, seed=2)
    one_shot = full.run()
    outs = []
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    for ctx, n in zip(starts, pieces):
        chunk = Batch([(ctx, n)], 8, 4, 2, 16, dtype=dtype, seed=99)
        chunk.keys[0] = full.keys[0][: ctx + n]
        chunk.values[0] = full.values[0][: ctx + n]
        chunk.queries[0] = full.queries[0][ctx : ctx + n]
        table = chunk.tables[0]
        for p in range(ctx):
            chunk.k_cache[table[p // 8], p % 8] = full.keys[0][p]
            chunk.v_cache[table[p // 8], p % 8] = full.values[0][p]
        outs.append(chunk.run())
    assert torch.equal(torch.cat(outs), one_shot)


def _encoded_batch(specs: list[tuple[int, int]]) -> Batch:
    """Queries and keys that carry their own position (and head) in their values."""
    b = Batch(specs, 4, 4, 2, 16, seed=6)
    for i, (ctx, n) in enumerate(specs):
        length = ctx + n
        pos = torch.arange(length, dtype=b.dtype)
        k = torch.zeros((length, 2, 16), dtype=b.dtype)
        k[..., 0], k[..., 3] = 1, pos.unsqueeze(1)
        v = torch.zeros((length, 2, 16), dtype=b.dtype)
        v[..., 4] = pos.unsqueeze(1)
        q = torch.zeros((n, 4, 16), dtype=b.dtype)
        q[..., 0], q[..., 1] = 1, pos[ctx:].unsqueeze(1)
        q[..., 2] = torch.arange(4, dtype=b.dtype)
        b.keys[i], b.values[i], b.queries[i] = k, v, q
        table = b.tables[i]
        for p in range(ctx):
            b.k_cache[table[p // 4], p % 4] = k[p]
            b.v_cache[table[p // 4], p % 4] = v[p]
    return b


def test_gemm_operands_hold_the_tokens_their_labels_name() -> None:
    """The placement labels the structural test checks are the operands' real contents."""
    b = _encoded_batch([(10, 7), (0, 70), (33, 1), (64, 2)])
    calls: list[gemm.GemmCall] = []
    with gemm.observe(calls.append):
        b.run()
    assert {c.kind for c in calls} == {
        "attention.scores",
        "attention.values",
        "attention.denominators",
    }
    for c in calls:
        q = c.a if c.kind == "attention.scores" else None
        rows = c.row_labels
        assert rows is not None
        if q is not None:  # [B, C, D]: column 0 is the scale, 1 the position, 2 the head
            real = q[..., 0] != 0
            item = (rows >= 0).any(dim=1)  # padding items repeat a real tile; ignored
            assert torch.equal(real[item], rows[item] >= 0)
            pos = torch.round(q[..., 1] / q[..., 0]).long()
            head = torch.round(q[..., 2] / q[..., 0]).long()
            labelled = rows >= 0
            assert torch.equal((pos * 4 + head)[labelled], rows[labelled])
            keys = c.b.transpose(1, 2)  # [B, KEY_CHUNK, D]
            labels = c.col_labels
        elif c.kind == "attention.values":
            keys, labels = c.b, c.inner_labels  # V: column 4 holds the position
        else:
            continue
        assert labels is not None
        has = labels >= 0
        column = 3 if c.kind == "attention.scores" else 4
        assert torch.equal(keys[..., column].round().long()[has], labels[has])


def test_plan_places_every_query_once_by_position() -> None:
    n = 2 * KEY_CHUNK + 5
    bs = 16
    t0 = list(range(1, 1 + -(-n // bs)))
    t1 = [20, 21, 22]
    slots = [t0[p // bs] * bs + p % bs for p in range(n)] + [t1[39 // bs] * bs + 39 % bs]
    meta = AttentionMetadata.build([0, n, n + 1], [n, 40], [t0, t1], slots, bs)
    plan = meta.plan
    valid = plan.tile_positions >= 0
    rows = plan.tile_rows[valid]
    assert sorted(rows.tolist()) == list(range(meta.num_tokens))
    assert torch.equal(plan.tile_positions[valid], meta.positions[rows])
    slot = torch.arange(QUERY_TILE).expand_as(plan.tile_positions)
    assert torch.equal(plan.tile_positions[valid] % QUERY_TILE, slot[valid])
    # Every tile gets its chunks 0..own, own chunk first; keys at row p % KEY_CHUNK.
    own = plan.tile_positions.max(dim=1).values // KEY_CHUNK
    chunks = plan.key_positions.max(dim=1).values // KEY_CHUNK
    for t in range(plan.num_tiles):
        mine = (plan.item_tiles == t).nonzero().flatten()
        assert int(mine[0]) == t and int(chunks[t]) == int(own[t])
        assert sorted(chunks[mine].tolist()) == list(range(int(own[t]) + 1))
    has = plan.key_positions >= 0
    assert torch.equal(
        plan.key_positions[has] % KEY_CHUNK, torch.arange(KEY_CHUNK).expand_as(has)[has]
    )


def test_metadata_accepts_padded_tensor_tables() -> None:
    tables = torch.tensor([[4, 9, -1], [2, -1, -1]])
    meta = AttentionMetadata.build([0, 2, 3], [6, 1], tables, [9 * 4 + 0, 9 * 4 + 1, 2 * 4], 4)
    assert meta.positions.tolist() == [4, 5, 0]
    assert meta.last_token_indices().tolist() == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query_start_loc": [1, 2]}, "start at 0"),
        ({"query_start_loc": [0, 3, 2]}, "non-decreasing"),
        ({"seq_lens": [2, 1]}, "new tokens"),
        ({"seq_lens": [3]}, "seq_lens has shape"),
        ({"block_tables": [[1], [2]]}, "block table has 1 blocks"),
        ({"slot_mapping": [7, 8, 99, 12]}, r"slot_mapping\[2\]"),
        ({"slot_mapping": [8, 9]}, "slot_mapping has shape"),
        ({"block_size": 0}, "block_size"),
        ({"block_tables": [[-2, 3], [3]]}, "negative"),
    ],
)
def test_metadata_validation(kwargs, match) -> None:
    args = {
        "query_start_loc": [0, 3, 4],
        "seq_lens": [6, 1],
        "block_tables": [[1, 2], [3]],
        "slot_mapping": [4 + 3, 8, 9, 12],
        "block_size": 4,
    }
    # Sequence 0 has 3 context tokens and 3 new ones (positions 3..5).
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(**args)


def test_write_kv_rejects_slots_outside_the_cache() -> None:
    k = torch.zeros(4, 2, 1, 8)
    v = torch.zeros(4, 2, 1, 8)
    new = torch.ones(1, 1, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        write_kv(k, v, new, new, torch.tensor([8]))


def test_check_kv_cache_shapes() -> None:
    k = torch.zeros(4, 16, 2, 8)
    check_kv_cache(k, k.clone(), 16, 2, 8)
    with pytest.raises(ValueError, match="expected"):
        check_kv_cache(k, k, 8, 2, 8)
    with pytest.raises(ValueError, match="same shape and dtype"):
        check_kv_cache(k, k.double(), 16, 2, 8)
