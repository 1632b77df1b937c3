"""A Llama-style decoder (Llama / Qwen2 architecture) over a paged KV cache.

RMSNorm, rotary embeddings (HF's "rotate_half" convention: dimension ``i`` is
paired with ``i + head_dim/2``, so HF checkpoints load unchanged), grouped-query
attention (``kvoffload.engine.attention``) and a SwiGLU MLP. Module and
parameter names mirror HF's ``LlamaForCausalLM`` (``model.layers.N.self_attn.
q_proj.weight``, ``lm_head.weight``, ...), so ``state_dict()`` *is* the
checkpoint format.

Batch invariance
----------------
A token's result must not depend on what else is in the step (other
sequences, how its own prompt was chunked), so that KV computed anywhere is
interchangeable and greedy outputs match bit for bit. A GEMM's summation order
depends on its shape and on where a row sits in it (``kvoffload.engine.gemm``),
so:

* a step's tokens are laid out once in a stack of ``ROW_TILE``-row tiles,
  token at position ``p`` in row ``p % ROW_TILE`` of some tile (tokens of
  different sequences share tiles; empty rows are zeros), and every layer
  works on that stack;
* every linear layer multiplies tile by tile, ``[ROW_TILE, in] @ [in, out]``
  (``gemm.tiled_matmul``), with the weights transposed once and q/k/v and
  gate/up fused (``DecoderLM.gemm_shapes`` lists every shape); so does the LM
  head, on the rows whose logits are asked for, laid out the same way;
* attention places queries and keys by position too (``attention``);
* the rest is per row and elementwise: RMSNorm reduces each row on its own,
  SiLU is ``x / (1 + exp(-x))`` (``F.silu``'s scalar tail path rounds
  differently from its vector path), the other elementwise ops are exactly
  rounded, and ``exp``'s vector and scalar paths agree.

So a row's result depends only on its own inputs and position, under the
assumptions stated in ``gemm`` and checked by
``tests/engine/test_gemm_conformance.py``; the model tests check bit identity
across batching and chunking for float32, float64 and bfloat16. float32 is
the recommended dtype (2-3x faster than float64 on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from kvoffload.engine import gemm
from kvoffload.engine.attention import (
    AttentionMetadata,
    check_kv_cache,
    paged_attention,
    write_kv,
)
from kvoffload.engine.gemm import ROW_TILE, GemmShape, RowTiles, row_tiles
from kvoffload.engine.model_config import ModelConfig

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


class FusedWeights:
    """The transposed weights of some linear layers side by side, ``[in, sum(out)]``,
    and their biases (or None), rebuilt whenever a weight or bias is replaced or
    modified in place (a version counter bump: ``load_state_dict``, ``copy_``).

    A contiguous ``[in, out]`` operand is markedly faster than a transposed
    view, and one wider GEMM beats several narrow ones.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        self._linears = linears
        self._key: tuple[tuple[int, int], ...] | None = None
        self._value: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _state(self) -> tuple[tuple[int, int], ...]:
        params = [p for lin in self._linears for p in (lin.weight, lin.bias) if p is not None]
        return tuple((p.data_ptr(), _version(p)) for p in params)

    def get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = self._state()
        if self._value is None or key != self._key:
            with torch.no_grad():
                weight = torch.cat([lin.weight.detach() for lin in self._linears]).t().contiguous()
                biases = [lin.bias for lin in self._linears]
                bias = None
                if any(b is not None for b in biases):
                    bias = torch.cat(
                        [
                            b.detach() if b is not None else lin.weight.new_zeros(lin.out_features)
                            for b, lin in zip(biases, self._linears)
                        ]
                    )
            self._value, self._key = (weight, bias), key
        assert self._value is not None
        return self._value

    @property
    def shape(self) -> tuple[int, int]:
        return self._linears[0].in_features, sum(lin.out_features for lin in self._linears)


def fused_linear(x: torch.Tensor, fused: FusedWeights, tiles: RowTiles, kind: str) -> torch.Tensor:
    """``x @ W.T + b`` of the fused layers over the tile stack ``x``."""
    weight, bias = fused.get()
    y = gemm.tiled_matmul(x, weight, tiles, kind)
    if bias is not None:
        y += bias
    return y


class RMSNorm(nn.Module):
    """HF Llama RMSNorm: normalise in (at least) float32, scale after casting back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` in float32, with rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, ramp, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_position``, looked up per token.

    A table makes a position's rotation independent of the batch; entries are
    computed in float32 (as HF does) and cast to the model dtype.
    """

    # Buffers (registered below), declared for the type checker.
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = pos.unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = config.torch_dtype
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` to ``positions`` ``[T]``."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=config.o_proj_bias)
        self.qkv = FusedWeights(self.q_proj, self.k_proj, self.v_proj)
        self.out = FusedWeights(self.o_proj)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        tiles: RowTiles,
    ) -> torch.Tensor:
        rows = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = fused_linear(x, self.qkv, tiles, "qkv_proj")
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
        q = rotary(q.view(rows, self.num_heads, self.head_dim), positions)
        k = rotary(k.view(rows, self.num_kv_heads, self.head_dim), positions)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k[tiles.rows], v[tiles.rows], meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, token_rows=tiles.rows)
        return fused_linear(o.view(rows, q_size), self.out, tiles, "o_proj")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.gate_up = FusedWeights(self.gate_proj, self.up_proj)
        self.down = FusedWeights(self.down_proj)

    def forward(self, x: torch.Tensor, tiles: RowTiles) -> torch.Tensor:
        gate, up = fused_linear(x, self.gate_up, tiles, "gate_up_proj").chunk(2, dim=1)
        return fused_linear(silu(gate) * up, self.down, tiles, "down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        tiles: RowTiles,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, rotary, meta, kv_cache, tiles)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), tiles)


class DecoderBody(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers as what they are (``nn.ModuleList`` yields plain modules)."""
        return cast("list[DecoderLayer]", list(self.layers))


class DecoderLM(nn.Module):
    """A causal LM whose ``forward`` runs one engine step over a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head = FusedWeights(self.lm_head)
        self.rotary = RotaryEmbedding(config)
        self.to(config.torch_dtype)

    def gemm_shapes(self) -> frozenset[GemmShape]:
        """Every GEMM shape ``forward`` and ``compute_logits`` use (the declared set)."""
        cfg = self.config
        dtype = cfg.torch_dtype
        shapes = {
            gemm.linear_shape(ROW_TILE, *fused.shape, dtype)
            for layer in self.model.decoder_layers()
            for fused in (
                layer.self_attn.qkv,
                layer.self_attn.out,
                layer.mlp.gate_up,
                layer.mlp.down,
            )
        }
        shapes.add(gemm.linear_shape(ROW_TILE, *self.head.shape, dtype))
        group = cfg.num_heads // cfg.num_kv_heads
        shapes.update(gemm.attention_shapes(cfg.head_dim, group, dtype))
        return frozenset(shapes)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: KVCaches,
        logits_indices: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One step: write the new tokens' KV into ``kv_caches`` and return logits.

        ``input_ids``/``positions`` are ``[T]`` (the batch's new tokens, flat);
        ``kv_caches[layer]`` is that layer's ``(k_cache, v_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype;
        ``logits_indices`` picks the rows to return logits for (default: the
        last new token of each sequence). Returns ``[len(logits_indices),
        vocab_size]`` in the model dtype.
        """
        cfg = self.config
        meta = attn_metadata
        n = meta.num_tokens
        input_ids = input_ids.reshape(-1)
        positions = positions.reshape(-1)
        if input_ids.numel() != n or positions.numel() != n:
            raise ValueError(
                f"input_ids/positions have {input_ids.numel()}/{positions.numel()} tokens, "
                f"attention metadata {n}"
            )
        positions = positions.cpu().long()
        if not torch.equal(positions, meta.positions):
            raise ValueError("positions disagree with seq_lens/query_start_loc")
        if n and int(positions.max()) >= cfg.max_position:
            raise ValueError(f"position {int(positions.max())} >= max_position {cfg.max_position}")
        if n and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            raise ValueError(f"input_ids outside the vocabulary [0, {cfg.vocab_size})")
        self._check_caches(meta, kv_caches)
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        elif not isinstance(logits_indices, torch.Tensor):
            logits_indices = torch.tensor(list(logits_indices), dtype=torch.long)
        logits_indices = logits_indices.long()
        if logits_indices.numel() and (
            int(logits_indices.min()) < 0 or int(logits_indices.max()) >= n
        ):
            raise ValueError(f"logits_indices must be in [0, {n})")

        tiles = row_tiles(positions, ROW_TILE)
        x = self.model.embed_tokens.weight.new_zeros((tiles.num_rows, cfg.hidden_size))
        x[tiles.rows] = self.model.embed_tokens(input_ids)
        rope_pos = tiles.row_positions.clamp(min=0)  # empty rows: any valid position
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, rope_pos, self.rotary, meta, kv, tiles)
        return self.compute_logits(x[tiles.rows[logits_indices]], positions[logits_indices])

    def compute_logits(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for ``hidden`` ``[n, hidden_size]``, the rows of tokens
        at ``positions`` ``[n]`` (each row's logits depend only on the row and
        its position)."""
        n = hidden.shape[0]
        if n == 0:
            return hidden.new_zeros((0, self.config.vocab_size))
        tiles = row_tiles(positions, ROW_TILE)
        stack = hidden.new_zeros((tiles.num_rows, hidden.shape[1]))
        stack[tiles.rows] = hidden
        logits = fused_linear(self.model.norm(stack), self.head, tiles, "lm_head")
        return logits[tiles.rows]

    def _check_caches(self, meta: AttentionMetadata, kv_caches: KVCaches) -> None:
        cfg = self.config
        if len(kv_caches) != cfg.num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {cfg.num_layers} layers")
        num_blocks = None
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            try:
                check_kv_cache(k_cache, v_cache, meta.block_size, cfg.num_kv_heads, cfg.head_dim)
            except ValueError as exc:
                raise ValueError(f"layer {i}: {exc}") from None
            if k_cache.dtype != cfg.torch_dtype:
                raise ValueError(
                    f"layer {i}: KV cache dtype {k_cache.dtype}, model dtype {cfg.torch_dtype}"
                )
            num_blocks = k_cache.shape[0]
        if num_blocks is not None and meta.plan.max_block >= num_blocks:
            raise ValueError(f"block tables reference blocks beyond the cache ({num_blocks})")


@torch.no_grad()
def init_weights(model: DecoderLM, seed: int) -> None:
    """Seeded random weights, the same on every machine (drawn on CPU in float32).

    Projections get std ``1/sqrt(fan_in)`` and embeddings std 1, so activations
    keep unit scale through the layers and the random model's logits are
    spread out (well-separated greedy choices); norm weights are ``1 +
    0.1 * N(0, 1)`` and biases ``0.1 * N(0, 1)`` so that no two tensors are
    alike (a checkpoint mapping error cannot go unnoticed).
    """
    gen = torch.Generator().manual_seed(int(seed))
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            values = 0.1 * torch.randn(p.shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            values = torch.randn(p.shape, generator=gen)
        else:
            values = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
        p.copy_(values.to(p.dtype))


def build_model(config: ModelConfig | None = None, seed: int = 0) -> DecoderLM:
    """The model for ``config`` (default: the embedded ``ModelConfig()``) with seeded
    random weights, in eval mode. Same seed, same weights."""
    config = config or ModelConfig()
    model = DecoderLM(config)
    init_weights(model, seed)
    return model.eval()
