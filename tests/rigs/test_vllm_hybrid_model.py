"""The tiny hybrid models' configs (no transformers needed): what each architecture is, and
that kvoffload's reference engine refuses every one of them in one line naming its layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.engine.model_config import ModelConfig, hybrid_layers
from tests.rigs.vllm_hybrid_model import (
    GRANITE4_LAYER_TYPES,
    LAYER_BLOCK_BYTES,
    LAYER_TYPES,
    WINDOW,
    gemma3_config_kwargs,
    gptoss_config_kwargs,
    granite4_config_kwargs,
    make_tiny_hybrid,
)


def test_sliding_and_full_layers_alternate() -> None:
    assert LAYER_TYPES == ("sliding_attention", "full_attention") * 2
    assert GRANITE4_LAYER_TYPES == ("mamba", "attention") * 2
    for kwargs in (gemma3_config_kwargs(), gptoss_config_kwargs()):
        assert kwargs["layer_types"] == list(LAYER_TYPES)
        assert kwargs["sliding_window"] == WINDOW
        # vLLM's CPU attention needs a head size of at least 32.
        assert kwargs["head_dim"] >= 32
    # One 32-token block of one layer: K and V, 2 heads of 32, float32.
    assert LAYER_BLOCK_BYTES == 2 * 2 * 32 * 32 * 4


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (gemma3_config_kwargs(), "sliding-window attention (layer_types: 2 sliding_attention"),
        (gptoss_config_kwargs(), "sliding-window attention (layer_types: 2 sliding_attention"),
        (granite4_config_kwargs(), "mamba layers (layer_types: 2 mamba of 4 layers)"),
    ],
)
def test_the_reference_engine_names_what_it_cannot_run(kwargs: dict, words: str) -> None:
    what = hybrid_layers(kwargs)
    assert what is not None and words in what
    with pytest.raises(ValueError, match="hybrid model"):
        ModelConfig.from_hf_config(kwargs)


def test_unknown_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: gemma3, granite4, gptoss"):
        make_tiny_hybrid(tmp_path / "m", arch="mamba9")
