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
interchangeable and greedy outputs match bit for bit. CPU GEMMs choose
kernels, and with them summation orders, from the matrix shapes and split a
lone GEMM across threads. So every linear layer runs as a *batch* of
fixed-shape GEMMs: the step's rows are padded to a multiple of ``ROW_TILE``
(at least two tiles) and multiplied tile by tile with ``torch.bmm``; a row's
result is then the same in any batch. Elementwise ops are exactly rounded or
(``exp``) give the same result on vector and scalar paths; SiLU is written as
``x / (1 + exp(-x))`` because ``F.silu``'s scalar tail path rounds differently
from its vector path. RMSNorm reduces each row on its own. Attention is
invariant by construction (see ``attention``). Tests check all of this with
exact equality for float32 and float64 on CPU (results were also identical
with 1 and 2 torch threads); bfloat16/float16 are supported but not claimed
invariant. float32 is the recommended dtype: invariant and 2-3x faster than
float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kvoffload.engine.attention import (
    AttentionMetadata,
    check_kv_cache,
    paged_attention,
    write_kv,
)
from kvoffload.engine.model_config import ModelConfig

# Rows per linear-layer GEMM. Small, because a decode step pads to two tiles
# (16 rows); 16 or 32 would be a little faster for prefill only.
ROW_TILE = 8

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def padded_rows(n: int) -> int:
    """Rows a step of ``n`` tokens is padded to: a multiple of ``ROW_TILE``, >= two tiles."""
    return max(2, -(-n // ROW_TILE)) * ROW_TILE


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[R, in]`` with ``R`` a multiple of ``ROW_TILE``
    (at least two tiles), as a batch of ``[ROW_TILE, in] @ [in, out]`` GEMMs."""
    rows, fan_in = x.shape
    tiles = rows // ROW_TILE
    w = weight.t().unsqueeze(0).expand(tiles, fan_in, weight.shape[0])
    y = torch.bmm(x.view(tiles, ROW_TILE, fan_in), w).view(rows, weight.shape[0])
    if bias is not None:
        y = y + bias
    return y


class TiledLinear(nn.Linear):
    """``nn.Linear`` whose forward is ``tiled_linear`` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.weight, self.bias)


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
        self.q_proj = TiledLinear(h, config.q_size, bias=config.attention_bias)
        self.k_proj = TiledLinear(h, config.kv_size, bias=config.attention_bias)
        self.v_proj = TiledLinear(h, config.kv_size, bias=config.attention_bias)
        self.o_proj = TiledLinear(config.q_size, h, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        rows = x.shape[0]
        n = meta.num_tokens
        q = rotary(self.q_proj(x).view(rows, self.num_heads, self.head_dim), positions)
        k = rotary(self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k[:n], v[:n], meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.view(rows, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = TiledLinear(h, i, bias=config.mlp_bias)
        self.up_proj = TiledLinear(h, i, bias=config.mlp_bias)
        self.down_proj = TiledLinear(i, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


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
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """A causal LM whose ``forward`` runs one engine step over a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = TiledLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        self.to(config.torch_dtype)

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
        if not torch.equal(positions.cpu().long(), meta.positions):
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

        rows = padded_rows(n)
        ids = input_ids.new_zeros(rows)
        ids[:n] = input_ids
        pos = positions.new_zeros(rows).long()
        pos[:n] = positions
        x = self.model.embed_tokens(ids)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, pos, self.rotary, meta, kv)
        return self.compute_logits(x[logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for ``hidden`` ``[n, hidden_size]`` (any ``n``, row-invariant)."""
        n = hidden.shape[0]
        if n == 0:
            return hidden.new_zeros((0, self.config.vocab_size))
        rows = padded_rows(n)
        padded = hidden.new_zeros((rows, hidden.shape[1]))
        padded[:n] = hidden
        return self.lm_head(self.model.norm(padded))[:n]

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
        for bucket in meta.buckets:
            if num_blocks is not None and int(bucket.tables.max()) >= num_blocks:
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
