"""The reference model's hyper-parameters, validated, and their mapping from HF config.json.

``ModelConfig()`` is the embedded default: a ~4M-parameter Llama-style model
that runs fast on two CPU cores. ``ModelConfig.from_hf_config`` reads the
``config.json`` of a Llama (``LlamaForCausalLM``) or Qwen2
(``Qwen2ForCausalLM``) checkpoint.

The engine runs one kind of layer (full causal attention, one KV cache
group): ``hybrid_layers`` names what a hybrid checkpoint has beyond that
(sliding-window, chunked local, Mamba / linear-attention layers), and
``from_hf_config`` refuses it in one line before anything else.

Qwen2 differs from Llama only in having biases on the q/k/v projections (and
nothing on o_proj); Llama's optional ``attention_bias`` puts a bias on all four
projections. Both are expressed with ``attention_bias`` (q/k/v) and
``o_proj_bias``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM")

# Model compute dtypes; batch invariance (see ``kvoffload.engine.model``) is
# verified for float32 and float64 on CPU.
MODEL_DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")

_DTYPE_NAMES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}

ROPE_SCALING_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


def normalize_dtype_name(value: str | torch.dtype) -> str:
    """A ``MODEL_DTYPES`` name from a dtype or a name such as "bf16" or "torch.float32"."""
    name = str(value).strip().lower().removeprefix("torch.")
    name = _DTYPE_NAMES.get(name, name)
    if name not in MODEL_DTYPES:
        raise ValueError(f"unsupported model dtype {value!r}; supported: {', '.join(MODEL_DTYPES)}")
    return name


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-style decoder.

    Invariants (checked in ``__post_init__``, ``ValueError`` naming the field):
    sizes are positive ints, ``num_heads`` is a multiple of ``num_kv_heads``,
    ``head_dim`` is even (rotary pairs dimension ``i`` with ``i + head_dim/2``),
    ``rope_theta`` and ``rms_norm_eps`` are positive, ``dtype`` is one of
    ``MODEL_DTYPES`` (stored as its name) and ``rope_scaling`` is None or a
    supported scaling (stored as a sorted tuple of items, so configs stay
    hashable).
    """

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    o_proj_bias: bool = False  # bias on o_proj too (Llama with attention_bias=true)
    mlp_bias: bool = False
    dtype: str = "float32"
    rope_scaling: tuple[tuple[str, Any], ...] | None = field(default=None)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "o_proj_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        try:
            object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype))
        except ValueError as exc:
            raise ValueError(f"ModelConfig.dtype: {exc}") from None
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))

    # -- derived ----------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + head

    # -- HF config.json -----------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls, hf: Mapping[str, Any], dtype: str | torch.dtype | None = None
    ) -> ModelConfig:
        """Map a Llama/Qwen2 ``config.json`` (as a dict) to a ``ModelConfig``.

        ``dtype`` is the compute dtype; None means float32 (as HF's
        ``from_pretrained`` does by default), whatever the checkpoint's
        ``torch_dtype`` is: on CPU float32 is both faster and batch-invariant.
        Raises ``ValueError`` for an unsupported architecture or option, or a
        missing key.
        """
        arch = _hf_architecture(hf)

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ValueError(f"config.json has no {key!r}")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads")
            head_dim = hidden // heads
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        if dtype is None:
            dtype = "float32"
        rope_theta, scaling = _hf_rope(hf)
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            dtype=normalize_dtype_name(dtype),
            rope_scaling=_rope_scaling_items(scaling),
            architecture=arch,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict HF would write for this model."""
        is_qwen = self.architecture == "Qwen2ForCausalLM"
        if is_qwen and (not self.attention_bias or self.o_proj_bias or self.mlp_bias):
            raise ValueError(
                "a Qwen2 config needs attention_bias=True, o_proj_bias=False, mlp_bias=False"
            )
        if not is_qwen and self.attention_bias != self.o_proj_bias:
            raise ValueError(
                "Llama's attention_bias covers q/k/v and o_proj together; q/k/v-only bias "
                "is Qwen2 (architecture='Qwen2ForCausalLM')"
            )
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if is_qwen else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "rope_scaling": self.rope_scaling_dict,
        }
        if is_qwen:
            out["use_sliding_window"] = False
        else:
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_scaling"] = self.rope_scaling_dict
        return d


def _hf_architecture(hf: Mapping[str, Any]) -> str:
    """The supported architecture a ``config.json`` names (or its ``model_type`` implies)."""
    # Before the architecture check: a Gemma 3 or a Qwen3-Next should hear what
    # it has that this engine cannot run, not only that its name is unknown.
    hybrid = hybrid_layers(hf)
    if hybrid is not None:
        raise ValueError(
            f"hybrid model: kvoffload's reference engine runs full-attention layers only, "
            f"not {hybrid} (serve it with vLLM and kvoffload's connector, docs/vllm.md)"
        )
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = hf.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        if archs or model_type not in by_type:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = by_type[model_type]
    return str(arch)


def _hf_rope(hf: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(rope_theta, rope_scaling)`` as a ``config.json`` gives them (not checked yet)."""
    # transformers >= 5 writes ``rope_parameters`` (theta + scaling in one
    # mapping) where older versions wrote ``rope_theta`` and ``rope_scaling``.
    rope = hf.get("rope_parameters")
    if isinstance(rope, Mapping):
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        return theta, {k: v for k, v in rope.items() if k != "rope_theta"}
    return hf.get("rope_theta", 10000.0), hf.get("rope_scaling")


#: ``layer_types`` entries that are plain causal attention over the whole sequence.
_FULL_ATTENTION_KINDS = frozenset({"full_attention", "attention", "global", "full"})
#: ``config.json`` keys that only Mamba / SSM / linear-attention / convolution layers have.
_RECURRENT_KEYS: tuple[str, ...] = (
    "hybrid_override_pattern",  # Nemotron-H
    "layers_block_type",  # Zamba, Zamba 2
    "attn_layer_period",  # Jamba
    "attn_type_list",  # MiniMax
    "linear_num_value_heads",  # Qwen3-Next
    "linear_conv_kernel_dim",
    "mamba_d_state",  # Granite 4, Falcon-H1, Bamba, Jamba, Nemotron-H
    "mamba_d_ssm",
    "mamba_expand",
    "ssm_state_size",
    "conv_L_cache",  # LFM2
    "lru_width",  # RecurrentGemma
)
#: Model types made of recurrent layers only, or that mix them with attention.
_RECURRENT_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1",
        "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2", "minimax", "plamo2",
        "recurrent_gemma", "rwkv",
    }
)  # fmt: skip


def hybrid_layers(hf: Mapping[str, Any]) -> str | None:
    """What in a ``config.json`` the reference engine cannot run, in words; None if nothing.

    The reference engine runs one kind of layer: causal attention over the
    whole sequence (one KV cache group). A config is *hybrid* for it when any
    layer is something else: sliding-window attention (``layer_types`` with a
    sliding kind, ``use_sliding_window=true``, or a ``sliding_window`` /
    ``sliding_window_pattern`` where no ``use_sliding_window`` switches it off,
    as Mistral, Gemma 2 / 3, Cohere 2 and gpt-oss write it), chunked local
    attention (Llama 4's ``attention_chunk_size``), or Mamba / SSM /
    linear-attention / convolution layers. A multimodal config's
    ``text_config`` is read too. Qwen2's ``sliding_window`` beside
    ``use_sliding_window=false`` is not hybrid (every layer is full attention).
    """
    found: list[str] = []
    configs = [hf]
    if isinstance(hf.get("text_config"), Mapping):
        configs.append(hf["text_config"])
    for cfg in configs:
        found.extend(_hybrid_reasons(cfg))
    return "; ".join(dict.fromkeys(found)) if found else None


def _hybrid_reasons(cfg: Mapping[str, Any]) -> list[str]:
    reasons: list[str] = []
    window = cfg.get("sliding_window")
    at = f", window {window}" if window else ""
    kinds = cfg.get("layer_types")
    other: dict[str, int] = {}
    num_layers = 0
    if isinstance(kinds, (list, tuple)):
        num_layers = len(kinds)
        for kind in kinds:
            if str(kind) not in _FULL_ATTENTION_KINDS:
                other[str(kind)] = other.get(str(kind), 0) + 1
    if other:
        listed = ", ".join(f"{n} {kind}" for kind, n in other.items())
        what = (
            "sliding-window attention"
            if all("sliding" in kind for kind in other)
            else f"{' / '.join(k for k in other if 'sliding' not in k)} layers"
        )
        reasons.append(f"{what} (layer_types: {listed} of {num_layers} layers{at})")
    elif cfg.get("use_sliding_window"):
        reasons.append(f"sliding-window attention (use_sliding_window=true{at})")
    elif "use_sliding_window" not in cfg and (
        window or cfg.get("sliding_window_pattern") or cfg.get("interleaved_sliding_window")
    ):
        pattern = cfg.get("sliding_window_pattern")
        every = f", pattern {pattern}" if pattern else ""
        reasons.append(f"sliding-window attention (sliding_window={window}{every})")
    if cfg.get("attention_chunk_size"):
        reasons.append(
            f"chunked local attention (attention_chunk_size={cfg['attention_chunk_size']})"
        )
    keys = [k for k in _RECURRENT_KEYS if cfg.get(k) is not None]
    model_type = cfg.get("model_type")
    if keys or model_type in _RECURRENT_MODEL_TYPES:
        named = f"model_type {model_type!r}" if model_type in _RECURRENT_MODEL_TYPES else ""
        named = ", ".join(x for x in (named, *keys[:2]) if x)
        reasons.append(f"Mamba / SSM / linear-attention layers ({named})")
    return reasons


def _rope_scaling_items(value: Any) -> tuple[tuple[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"rope_scaling must be a mapping or null, got {value!r}")
    return tuple(sorted((str(k), v) for k, v in value.items()))


def _normalize_rope_scaling(value: Any) -> tuple[tuple[str, Any], ...] | None:
    items = _rope_scaling_items(dict(value) if isinstance(value, tuple) else value)
    if items is None:
        return None
    d = dict(items)
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_SCALING_TYPES)}"
        )
    if kind == "default":
        return None
    needed = (
        ("factor",)
        if kind == "linear"
        else (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
    )
    for key in needed:
        v = d.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"rope_scaling {kind!r} needs a positive {key!r}, got {v!r}")
    if kind == "llama3" and d["high_freq_factor"] <= d["low_freq_factor"]:
        raise ValueError("rope_scaling llama3 needs high_freq_factor > low_freq_factor")
    # Canonical form (HF spells the type ``type`` or ``rope_type`` and may carry
    # unused keys), so equal scalings compare equal.
    return tuple(sorted([("rope_type", kind), *((k, d[k]) for k in needed)]))
