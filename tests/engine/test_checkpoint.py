"""Local HF-format checkpoints: round trips give identical logits; bad input fails clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvoffload.engine.attention import AttentionMetadata
from kvoffload.engine.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    load_model,
    load_model_config,
    save_model,
)
from kvoffload.engine.model import DecoderLM, build_model
from kvoffload.engine.model_config import ModelConfig
from kvoffload.transfer.layout import KVGeometry, KVLayout

QWEN_LIKE = ModelConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    architecture="Qwen2ForCausalLM",
)


def logits_of(model: DecoderLM, tokens: list[int], block_size: int = 8) -> torch.Tensor:
    """All-position logits of one prompt through a fresh paged cache."""
    cfg = model.config
    geo = KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, cfg.dtype)
    layout = KVLayout(geo)
    n = len(tokens)
    table = list(range(1, 1 + -(-n // block_size)))
    tensors = layout.allocate(len(table) + 1)
    kv = [layout.layer_kv(tensors, i) for i in range(cfg.num_layers)]
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    meta = AttentionMetadata.build([0, n], [n], [table], slots, block_size)
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(n), meta, kv, torch.arange(n))


def tokens_for(cfg: ModelConfig) -> list[int]:
    return [(17 * i + 5) % cfg.vocab_size for i in range(40)]


@pytest.fixture(scope="module")
def saved_default(tmp_path_factory) -> tuple[DecoderLM, Path]:
    model = build_model(ModelConfig(), seed=3)
    return model, save_model(model, tmp_path_factory.mktemp("ckpt") / "default")


def test_round_trip_gives_identical_logits(saved_default) -> None:
    model, path = saved_default
    loaded, cfg = load_model(path)
    assert cfg == model.config
    assert not loaded.training
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    tokens = tokens_for(cfg)
    assert torch.equal(logits_of(loaded, tokens), logits_of(model, tokens))


def test_saved_files_use_hf_names_and_config(saved_default) -> None:
    model, path = saved_default
    hf = json.loads((path / CONFIG_FILE).read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["num_hidden_layers"] == model.config.num_layers
    assert hf["num_key_value_heads"] == model.config.num_kv_heads
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.norm.weight" in names
    assert load_model_config(path) == model.config


def test_tied_qwen2_round_trip(tmp_path) -> None:
    model = build_model(QWEN_LIKE, seed=1)
    save_model(model, tmp_path)
    hf = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["tie_word_embeddings"] is True
    names = set(load_file(str(tmp_path / WEIGHTS_FILE)))
    assert "lm_head.weight" not in names
    assert "model.layers.1.self_attn.k_proj.bias" in names
    assert "model.layers.1.self_attn.o_proj.bias" not in names
    loaded, cfg = load_model(tmp_path)
    assert cfg == QWEN_LIKE
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = tokens_for(cfg)
    assert torch.equal(logits_of(loaded, tokens), logits_of(model, tokens))


def test_tied_checkpoint_carrying_lm_head_and_inv_freq_loads(tmp_path) -> None:
    model = build_model(QWEN_LIKE, seed=1)
    save_model(model, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    loaded, _ = load_model(tmp_path)
    tokens = tokens_for(QWEN_LIKE)
    assert torch.equal(logits_of(loaded, tokens), logits_of(model, tokens))


def test_bf16_storage_loads_as_float32(tmp_path) -> None:
    model = build_model(QWEN_LIKE, seed=2)
    save_model(model, tmp_path, dtype="bfloat16")
    hf = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert hf["torch_dtype"] == "bfloat16"
    assert load_file(str(tmp_path / WEIGHTS_FILE))["model.norm.weight"].dtype == torch.bfloat16
    loaded, cfg = load_model(tmp_path)
    assert cfg.dtype == "float32"
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p.to(torch.bfloat16).float()), name
    as64, cfg64 = load_model(tmp_path, dtype="float64")
    assert cfg64.dtype == "float64" and as64.model.norm.weight.dtype == torch.float64


def test_sharded_checkpoint_with_index(tmp_path) -> None:
    model = build_model(QWEN_LIKE, seed=4)
    save_model(model, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    (tmp_path / WEIGHTS_FILE).unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded, _ = load_model(tmp_path)
    tokens = tokens_for(QWEN_LIKE)
    assert torch.equal(logits_of(loaded, tokens), logits_of(model, tokens))
    # Saving again over it drops the stale index, so the new single file is used.
    save_model(model, tmp_path)
    assert not (tmp_path / INDEX_FILE).exists()


def test_transformers_v5_style_config(tmp_path) -> None:
    model = build_model(QWEN_LIKE, seed=5)
    save_model(model, tmp_path)
    hf = json.loads((tmp_path / CONFIG_FILE).read_text())
    hf.pop("rope_scaling")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    hf["dtype"] = hf.pop("torch_dtype")
    (tmp_path / CONFIG_FILE).write_text(json.dumps(hf))
    loaded, cfg = load_model(tmp_path)
    assert cfg == QWEN_LIKE
    tokens = tokens_for(QWEN_LIKE)
    assert torch.equal(logits_of(loaded, tokens), logits_of(model, tokens))


# -- errors ------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path) -> Path:
    save_model(build_model(QWEN_LIKE, seed=0), tmp_path)
    return tmp_path


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


def test_missing_directory(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(tmp_path / "file")


def test_missing_or_broken_config(ckpt) -> None:
    (ckpt / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_model(ckpt)
    (ckpt / CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(ckpt)


def test_unsupported_architecture(ckpt) -> None:
    hf = json.loads((ckpt / CONFIG_FILE).read_text())
    hf["architectures"] = ["GPTNeoXForCausalLM"]
    hf["model_type"] = "gpt_neox"
    (ckpt / CONFIG_FILE).write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"unsupported architecture.*LlamaForCausalLM"):
        load_model(ckpt)


def test_no_weight_files(ckpt) -> None:
    (ckpt / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ckpt)


def test_index_naming_a_missing_shard(ckpt) -> None:
    weight_map = {"model.norm.weight": "model-00009.safetensors"}
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00009"):
        load_model(ckpt)


def test_missing_tensor(ckpt) -> None:
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.1\.mlp\.up_proj"):
        load_model(ckpt)


def test_missing_lm_head_when_untied(tmp_path) -> None:
    save_model(
        build_model(ModelConfig(**{**QWEN_LIKE.to_dict(), "tie_word_embeddings": False})), tmp_path
    )
    _edit_tensors(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(tmp_path)


def test_misshaped_tensor(ckpt) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _edit_tensors(ckpt, shrink)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    _edit_tensors(ckpt, add)
    with pytest.raises(ValueError, match=r"does not.*q_norm"):
        load_model(ckpt)


def test_config_disagreeing_with_weights(ckpt) -> None:
    hf = json.loads((ckpt / CONFIG_FILE).read_text())
    hf["intermediate_size"] = 128
    (ckpt / CONFIG_FILE).write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' has shape"):
        load_model(ckpt)
