"""Local Llama/Qwen2 checkpoints: a directory of ``config.json`` + safetensors.

Nothing is downloaded: ``path`` must be a local directory as HF's
``save_pretrained`` writes it, with one ``model.safetensors`` or shards listed
in ``model.safetensors.index.json`` (any ``*.safetensors`` files otherwise).
Tensor names are HF's (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``); with
tied embeddings ``lm_head.weight`` is absent (or ignored if present).

Errors are specific: a missing directory or ``config.json`` is
``FileNotFoundError``; an unsupported architecture, a missing, unexpected or
mis-shaped tensor, or a truncated or garbage weights file is ``ValueError``
naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvoffload.engine.model import DecoderLM
from kvoffload.engine.model_config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint path {str(p)!r} is not a directory")
    return p


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict."""
    cfg_path = _checkpoint_dir(path) / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no {CONFIG_FILE}")
    try:
        data = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    return data


def load_model_config(
    path: str | os.PathLike[str], dtype: str | torch.dtype | None = None
) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint at ``path`` (compute dtype ``dtype``,
    None = float32), without reading any weights."""
    hf = read_hf_config(path)
    try:
        return ModelConfig.from_hf_config(hf, dtype=dtype)
    except (ValueError, TypeError, KeyError) as exc:
        # Name the file: "invalid literal for int()" alone does not say where.
        where = Path(path).expanduser() / CONFIG_FILE
        text = str(exc)
        raise ValueError(text if str(where) in text else f"{where}: {text}") from None


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of the checkpoint, in a stable order."""
    root = _checkpoint_dir(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc})") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no *.safetensors file")
    return files


def _open_weights(file: Path) -> Any:
    """``safe_open`` of ``file``; a truncated or garbage file is a ``ValueError`` naming it."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError is not importable under a stable name
        raise ValueError(f"{file}: not a valid safetensors file ({exc})") from None


def _expected_tensors(model: DecoderLM) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the model's parameter (tied lm_head excluded)."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return params


def load_model(
    path: str | os.PathLike[str], dtype: str | torch.dtype | None = None
) -> tuple[DecoderLM, ModelConfig]:
    """Build the model described by ``path``'s ``config.json`` and load its weights.

    Weights are cast to the compute dtype (``dtype``, None = float32). Every
    parameter must be present with its exact shape; tensors the model does not
    have are an error (a checkpoint of another architecture), except ones it
    recomputes (``rotary_emb.inv_freq``) and ``lm_head.weight`` when embeddings
    are tied. Returns ``(model in eval mode, config)``.
    """
    config = load_model_config(path, dtype)
    files = weight_files(path)
    model = DecoderLM(config)
    expected = _expected_tensors(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            with _open_weights(file) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    target = expected.get(name)
                    if target is None:
                        tied_head = name == "lm_head.weight" and config.tie_word_embeddings
                        if not tied_head and not name.endswith(_IGNORED_SUFFIXES):
                            unexpected.append(name)
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(target.shape):
                        raise ValueError(
                            f"{file.name}: tensor {name!r} has shape {shape}, the config "
                            f"implies {tuple(target.shape)}"
                        )
                    if name in loaded:
                        raise ValueError(f"tensor {name!r} appears in more than one file")
                    target.copy_(f.get_tensor(name).to(target.dtype))
                    loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint {str(path)!r} is missing {len(missing)} tensor(s): {shown}")
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5])
        raise ValueError(
            f"checkpoint {str(path)!r} has {len(unexpected)} tensor(s) this "
            f"{config.architecture} model does not: {shown}"
        )
    return model.eval(), config


def save_model(
    model: DecoderLM, path: str | os.PathLike[str], dtype: str | torch.dtype | None = None
) -> Path:
    """Write ``model`` as a HF-style checkpoint: ``config.json`` + ``model.safetensors``.

    ``dtype`` converts the stored tensors (None = the model's dtype). The
    directory is created if needed; existing files of the same names are
    replaced. Returns the directory.
    """
    root = Path(path).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf = config.to_hf_config()
    store_dtype = config.torch_dtype
    if dtype is not None:
        # ModelConfig normalises (and checks) a torch.dtype as it does a name.
        store_dtype = getattr(torch, ModelConfig(dtype=cast(str, dtype)).dtype)
        hf["torch_dtype"] = str(store_dtype).removeprefix("torch.")
    tensors = {
        name: t.detach().to(store_dtype).contiguous().cpu()
        for name, t in _expected_tensors(model).items()
    }
    stale_index = root / INDEX_FILE
    if stale_index.exists():  # it would make loaders look for shards instead
        stale_index.unlink()
    save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return root
