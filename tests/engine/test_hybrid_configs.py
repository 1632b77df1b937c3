"""Hybrid checkpoints (layers other than full attention) are refused in one line naming what.

The reference engine runs one kind of layer. ``kvoffload run --model DIR`` with
a Gemma 3, a gpt-oss, a Qwen2 with ``use_sliding_window``, a Llama 4 (chunked
local attention) or a Mamba / linear-attention hybrid must end in one line
that says which layers it cannot run, before anything is loaded; Llama and
Qwen2 configs whose every layer is full attention still load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cli.main import main
from kvoffload.engine.model_config import ModelConfig, hybrid_layers

_BASE = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
}
_SW4 = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# (id, config.json, words the refusal must contain)
HYBRID: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    (
        "gemma3 layer_types",
        {**_BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
         "hidden_act": "gelu_pytorch_tanh", "sliding_window": 32, "layer_types": _SW4},
        ("sliding-window attention", "2 sliding_attention of 4 layers", "window 32"),
    ),
    (
        "gemma3 multimodal text_config",
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": {**_BASE, "model_type": "gemma3_text", "sliding_window": 512,
                         "sliding_window_pattern": 6}},
        ("sliding-window attention", "sliding_window=512", "pattern 6"),
    ),
    (
        "gemma2 window only",
        {**_BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
         "sliding_window": 4096},
        ("sliding-window attention", "sliding_window=4096"),
    ),
    (
        "gpt-oss",
        {**_BASE, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
         "sliding_window": 128, "layer_types": _SW4},
        ("sliding-window attention", "window 128"),
    ),
    (
        "mistral v0.1 window",
        {**_BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
         "sliding_window": 4096},
        ("sliding-window attention",),
    ),
    (
        "qwen2 use_sliding_window",
        {**_BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
         "sliding_window": 32768, "use_sliding_window": True, "max_window_layers": 2},
        ("sliding-window attention", "use_sliding_window=true", "window 32768"),
    ),
    (
        "llama with a sliding layer_types",
        {**_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "layer_types": _SW4, "sliding_window": 64},
        ("sliding-window attention", "window 64"),
    ),
    (
        "llama4 chunked",
        {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
         "text_config": {**_BASE, "model_type": "llama4_text", "attention_chunk_size": 8192}},
        ("chunked local attention", "attention_chunk_size=8192"),
    ),
    (
        "qwen3-next linear attention",
        {**_BASE, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
         "layer_types": ["linear_attention"] * 3 + ["full_attention"],
         "linear_num_value_heads": 32},
        ("linear_attention layers", "3 linear_attention", "Mamba / SSM / linear"),
    ),
    (
        "granite 4 mamba",
        {**_BASE, "architectures": ["GraniteMoeHybridForCausalLM"],
         "model_type": "granitemoehybrid", "layer_types": ["mamba"] * 3 + ["attention"],
         "mamba_d_state": 128},
        ("3 mamba of 4 layers", "Mamba / SSM / linear", "mamba_d_state"),
    ),
    (
        "nemotron-h pattern",
        {**_BASE, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
         "hybrid_override_pattern": "M-M*-"},
        ("Mamba / SSM / linear", "nemotron_h", "hybrid_override_pattern"),
    ),
    (
        "jamba",
        {**_BASE, "architectures": ["JambaForCausalLM"], "model_type": "jamba",
         "attn_layer_period": 8, "attn_layer_offset": 4},
        ("Mamba / SSM / linear", "attn_layer_period"),
    ),
    (
        "an unknown type with mamba keys",
        {**_BASE, "architectures": ["SomeHybridForCausalLM"], "model_type": "some_hybrid",
         "ssm_state_size": 16},
        ("Mamba / SSM / linear", "ssm_state_size"),
    ),
]  # fmt: skip

QWEN2 = {**_BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
LLAMA = {**_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
NOT_HYBRID: list[tuple[str, dict[str, Any]]] = [
    ("llama", LLAMA),
    ("llama sliding_window null", {**LLAMA, "sliding_window": None}),
    ("qwen2 window switched off", {**QWEN2, "sliding_window": 32768, "use_sliding_window": False}),
    (
        "qwen2 layer_types all full",
        {**QWEN2, "sliding_window": None, "use_sliding_window": False,
         "layer_types": ["full_attention"] * 4},
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "words"), [(c, w) for _, c, w in HYBRID], ids=[i for i, *_ in HYBRID]
)
def test_hybrid_configs_are_named(cfg: dict[str, Any], words: tuple[str, ...]) -> None:
    what = hybrid_layers(cfg)
    assert what is not None
    for word in words:
        assert word in what, what
    with pytest.raises(ValueError, match=r"^hybrid model: ") as info:
        ModelConfig.from_hf_config(cfg)
    assert "\n" not in str(info.value)
    assert what in str(info.value)


@pytest.mark.parametrize("cfg", [c for _, c in NOT_HYBRID], ids=[i for i, _ in NOT_HYBRID])
def test_full_attention_configs_still_load(cfg: dict[str, Any]) -> None:
    assert hybrid_layers(cfg) is None
    assert ModelConfig.from_hf_config(cfg).num_layers == 4


@pytest.mark.parametrize(
    ("cfg", "words"),
    [(c, w) for i, c, w in HYBRID if i in ("gemma3 layer_types", "qwen2 use_sliding_window",
                                           "granite 4 mamba", "llama4 chunked")],
)  # fmt: skip
def test_run_with_a_hybrid_checkpoint_is_one_line(
    cfg: dict[str, Any],
    words: tuple[str, ...],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvoffload run --model DIR``: one line on stderr, naming the layers, exit 2."""
    monkeypatch.delenv("KVOFFLOAD_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    try:
        code: object = main(["run", "--model", str(model), "--requests", "1"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("kvoffload: error: ") and "hybrid model" in lines[0], lines[0]
    assert str(model / "config.json") in lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    print(lines[0])
