"""A tiny random Llama that a real vLLM engine loads offline, on a CPU.

2 layers, hidden 128, 4 attention heads over 2 KV heads of 32 (vLLM's CPU
attention needs a head size of at least 32), vocabulary 2048 with a
word-level tokenizer (one word per token id, so any token list round-trips).
Weights are drawn from a fixed seed with a wide initialisation so that each
next-token distribution has a clear winner: greedy outputs then depend on
the KV they attend to (a wrong KV block shows as different tokens) rather
than on float rounding between batch shapes.

Needs ``transformers`` and ``tokenizers`` (vLLM depends on both).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB_SIZE = 2048
#: Token ids below this are special (unk, bos, eos); prompts use the rest.
FIRST_WORD_ID = 3
DEFAULT_SEED = 0
#: Files that a complete model directory holds (config written last).
MARKER = "kvoffload-tiny-llama.json"


def model_is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def write_word_tokenizer(out: Path, pad_token: str | None = None) -> None:
    """Save the word-level tokenizer to ``out``: word ``w{i}`` is token id ``i``.

    Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>``; words run from
    ``FIRST_WORD_ID`` to ``VOCAB_SIZE - 1``, so any token list round-trips.
    ``pad_token`` is set only when given (the tiny Llama's files never had one).
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)})
    tokenizer = Tokenizer(WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    special = {"unk_token": "<unk>"}
    if pad_token is not None:
        special["pad_token"] = pad_token
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **special,
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=4096,
    )
    fast.save_pretrained(out)


def save_seeded_model(out: Path, build: Callable[[], Any], seed: int, init_range: float) -> None:
    """Build a model with ``build()`` and save it to ``out`` with weights drawn from ``seed``.

    Every matrix (parameter of 2+ dimensions) is redrawn from N(0, ``init_range``)
    by a generator of its own; the global seed is set too, so whatever
    ``build()`` initialises at random (norms, biases) is the same every time.
    Same seed, same bytes.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, init_range, generator=generator)
    model.save_pretrained(out, safe_serialization=True)


def make_tiny_llama(
    path: str | Path, seed: int = DEFAULT_SEED, num_layers: int = 2, hidden_size: int = 128
) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent: a finished directory is kept).

    Two seeds give two different models (different weights, same shapes).
    ``num_layers`` / ``hidden_size`` scale it (heads of 32, half as many KV
    heads, an MLP twice as wide), e.g. 4 x 512 and 8 x 1024 for the hit bench.
    """
    out = Path(path)
    if model_is_complete(out):
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    # The engine venv's transformers takes `torch_dtype`; the stubs here only know `dtype`.
    dtype: dict[str, Any] = {"torch_dtype": "float32"}
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        head_dim=32,
        max_position_embeddings=4096,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **dtype,
    )
    save_seeded_model(out, lambda: LlamaForCausalLM(config), seed, config.initializer_range)
    write_word_tokenizer(out)
    (out / MARKER).write_text(json.dumps({"seed": seed, "vocab_size": VOCAB_SIZE}) + "\n")
    return out


def main() -> int:  # pragma: no cover - a convenience for the command line
    import argparse

    parser = argparse.ArgumentParser(description="write the tiny random Llama")
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    print(make_tiny_llama(args.path, args.seed, args.layers, args.hidden))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
