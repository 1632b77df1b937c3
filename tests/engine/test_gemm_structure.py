"""Structure: every GEMM the model makes has a declared shape, and every token a fixed place.

This is what protects bit identity on platforms we cannot test on (a BLAS that
picks kernels by shape): if each GEMM call has a shape from the declared set
and each token sits at a slot fixed by its position, a token's result cannot
depend on the rest of the step. Every aten op of the forward is seen through a
dispatch mode, so a GEMM that bypasses ``kvoffload.engine.gemm`` (a new
``F.linear``, ``@`` or ``einsum``) fails here too.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvoffload.engine import gemm
from kvoffload.engine.gemm import KEY_CHUNK, QUERY_TILE, ROW_TILE, GemmCall, GemmShape
from kvoffload.engine.model import DecoderLM, build_model
from kvoffload.engine.model_config import ModelConfig
from tests.engine.test_model import PagedSim, prompt

SMALL = ModelConfig(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
)
# Any aten op whose name has one of these is a matrix product of some kind.
GEMM_WORDS = ("mm", "matmul", "linear", "einsum", "dot", "mv", "tensordot", "conv", "bilinear")
ALLOWED_OPS = {"aten.mm.out": "mm", "aten.bmm.out": "bmm"}
PIECES = [1, 2, 3, 7, 64, 5, 1, 2, 13, 64, 1]


class GemmRecorder(TorchDispatchMode):
    """Records every matrix-product aten op with its operand shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        base = name.split(".")[1] if name.startswith("aten.") else name
        if any(w in base for w in GEMM_WORDS):
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.ops.append((name, shapes, dtype))
        return func(*args, **(kwargs or {}))


def _shape_of(name: str, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> GemmShape:
    a, b = shapes[0], shapes[1]
    if ALLOWED_OPS[name] == "mm":
        return GemmShape("mm", 1, a[0], a[1], b[1], dtype)
    return GemmShape("bmm", a[0], a[1], a[2], b[2], dtype)


def check_placement(call: GemmCall, cfg: ModelConfig) -> None:
    """Each labelled slot holds a token whose position alone decides the slot."""
    group = cfg.num_heads // cfg.num_kv_heads
    if call.kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        assert call.row_labels is not None, call.kind
        labels = call.row_labels[0]
        assert labels.numel() == ROW_TILE
        rows = torch.arange(ROW_TILE)
        real = labels >= 0
        assert torch.equal(labels[real] % ROW_TILE, rows[real]), (call.kind, labels)
        return
    assert call.kind in ("attention.scores", "attention.values", "attention.denominators")
    queries = call.row_labels
    keys = call.col_labels if call.kind == "attention.scores" else call.inner_labels
    assert queries is not None and keys is not None
    assert queries.shape[1] == QUERY_TILE * group and keys.shape[1] == KEY_CHUNK
    cols = torch.arange(QUERY_TILE * group)
    slots = torch.arange(KEY_CHUNK)
    for q, k in zip(queries, keys):
        real_q, real_k = q >= 0, k >= 0
        if not bool(real_q.any()):  # padding item or padding tile slots only
            continue
        pos, head = q[real_q] // cfg.num_heads, q[real_q] % cfg.num_heads
        # Column fixed by (position, head); one tile of aligned positions; one KV head.
        assert torch.equal((pos % QUERY_TILE) * group + head % group, cols[real_q])
        assert int((pos // QUERY_TILE).unique().numel()) == 1
        assert int((head // group).unique().numel()) == 1
        # Key row fixed by position; one chunk, at or before the tile's own.
        kp = k[real_k]
        assert torch.equal(kp % KEY_CHUNK, slots[real_k])
        assert int((kp // KEY_CHUNK).unique().numel()) <= 1
        if kp.numel():
            assert int(kp[0]) // KEY_CHUNK <= int(pos[0]) // KEY_CHUNK
        # Every key a query can see within the chunk is present.
        chunk_start = int(kp[0]) // KEY_CHUNK * KEY_CHUNK if kp.numel() else None
        if chunk_start is not None:
            need = min(int(pos.max()) + 1, chunk_start + KEY_CHUNK) - chunk_start
            assert bool(real_k[:need].all())


def run_schedule(model: DecoderLM, pieces: list[int], companions: list[int], seed: int) -> None:
    """One sequence prefilled in ``pieces`` while companions advance beside it."""
    cfg = model.config
    total = sum(pieces)
    sim = PagedSim(model, block_size=4, num_blocks=600, seed=seed)
    sim.add("s", prompt(total, cfg.vocab_size, salt=seed))
    for i, n in enumerate(companions):
        sim.add(f"c{i}", prompt(n + 40, cfg.vocab_size, salt=seed + i + 1))
    for step, n in enumerate(pieces):
        work = [("s", n)]
        for i, c in enumerate(companions):
            sid = f"c{i}"
            n_c = min(len(sim.tokens[sid]) - sim.computed[sid], (c + 3 * step) % 9)
            if n_c:  # a scheduler never schedules an item with no tokens
                work.insert((i + step) % (len(work) + 1), (sid, n_c))
        sim.step(work, all_logits=step % 2 == 0)


def record(model: DecoderLM, pieces: list[int], companions: list[int], seed: int):
    calls: list[GemmCall] = []
    recorder = GemmRecorder()
    with gemm.observe(calls.append), recorder:
        run_schedule(model, pieces, companions, seed)
    return calls, recorder.ops


@pytest.mark.parametrize(
    ("cfg", "dtype"),
    [(SMALL, "float32"), (SMALL, "bfloat16"), (ModelConfig(num_layers=1), "float64")],
)
def test_every_gemm_has_a_declared_shape_and_fixed_placement(cfg, dtype) -> None:
    model = build_model(ModelConfig(**{**cfg.to_dict(), "dtype": dtype}), seed=0)
    declared = model.gemm_shapes()
    calls, ops = record(model, PIECES, [0, 70, 5], seed=3)
    assert calls and ops
    for name, shapes, op_dtype in ops:
        assert name in ALLOWED_OPS, f"GEMM outside kvoffload.engine.gemm: {name} {shapes}"
        assert _shape_of(name, shapes, op_dtype) in declared, (name, shapes)
    # Every dispatched GEMM was an observed one, and every observed one was dispatched.
    assert len(ops) == len(calls)
    assert {c.shape for c in calls} <= declared
    kinds = {c.kind for c in calls}
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"} <= kinds
    assert {"attention.scores", "attention.values", "attention.denominators"} <= kinds
    for call in calls:
        check_placement(call, model.config)


def test_declared_set_is_small() -> None:
    model = build_model(ModelConfig(), seed=0)
    shapes = model.gemm_shapes()
    # 4 fused linear shapes per layer (all layers alike) + LM head + 3 attention GEMMs.
    assert len(shapes) == 8, shapes
    assert all(s.op == "mm" and s.m == ROW_TILE for s in shapes if s.op == "mm")


@pytest.fixture(scope="module")
def small_model() -> DecoderLM:
    return build_model(SMALL, seed=1)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    pieces=st.lists(st.sampled_from([1, 2, 3, 7, 64, 4, 9, 31]), min_size=1, max_size=6),
    companions=st.lists(st.integers(0, 80), max_size=3),
    seed=st.integers(0, 1000),
)
# A companion with no tokens to compute in some step (found by hypothesis in CI).
@example(pieces=[1, 1, 1, 1, 1, 1], companions=[0, 30], seed=0)
def test_random_schedules_keep_to_the_declared_shapes(small_model, pieces, companions, seed):
    calls, ops = record(small_model, pieces, companions, seed)
    declared = small_model.gemm_shapes()
    for name, shapes, op_dtype in ops:
        assert name in ALLOWED_OPS, f"GEMM outside kvoffload.engine.gemm: {name} {shapes}"
        assert _shape_of(name, shapes, op_dtype) in declared, (name, shapes)
    assert len(ops) == len(calls)
    for call in calls:
        check_placement(call, small_model.config)


def test_row_tiles_place_by_position() -> None:
    rng = random.Random(0)
    positions = torch.tensor([rng.randrange(500) for _ in range(200)] + list(range(37, 101)))
    tiles = gemm.row_tiles(positions, ROW_TILE)
    assert tiles.num_rows == tiles.num_tiles * ROW_TILE
    assert torch.equal(tiles.rows % ROW_TILE, positions % ROW_TILE)
    assert tiles.rows.unique().numel() == positions.numel()
    assert torch.equal(tiles.row_positions[tiles.rows], positions)
    counts = torch.bincount(positions % ROW_TILE, minlength=ROW_TILE)
    assert tiles.num_tiles == int(counts.max())  # as few tiles as the residues allow
    empty = gemm.row_tiles(torch.zeros(0, dtype=torch.long), ROW_TILE)
    assert empty.num_tiles == 1 and bool((empty.row_positions == -1).all())
