"""The worker side of the reference engine: KV cache tensors, batch inputs, the model.

The KV cache is allocated once through ``KVLayout`` and handed to the model
as per-layer ``(k_cache, v_cache)`` views; attention reads and writes it
through block tables, so a block copied in by the offload worker is read
exactly as if it had been computed here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.request import Request
from kvoffload.transfer.layout import KVGeometry, KVLayout


def _model_config(config: EngineConfig):
    from kvoffload.engine.checkpoint import load_model_config
    from kvoffload.engine.model_config import ModelConfig

    if config.model_path is None:
        return ModelConfig(dtype=config.dtype)
    return load_model_config(config.model_path, config.dtype)


def kv_geometry(model_config, block_size: int) -> KVGeometry:
    """The KV cache geometry of ``model_config`` (a ``ModelConfig``) in blocks of ``block_size``."""
    return KVGeometry(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_size=model_config.head_dim,
        block_size=block_size,
        dtype=model_config.torch_dtype,
    )


def peek_vocab_size(config: EngineConfig) -> int:
    """The model's vocabulary size without building the model."""
    return int(_model_config(config).vocab_size)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from kvoffload.engine.checkpoint import load_model
        from kvoffload.engine.model import build_model

        self.config = config
        torch.manual_seed(config.seed)
        if config.model_path is None:
            self.model_config = _model_config(config)
            self.model = build_model(self.model_config, seed=config.seed)
        else:
            self.model, self.model_config = load_model(config.model_path, config.dtype)
        self.model.eval()
        mc = self.model_config
        self.dtype = mc.torch_dtype
        self.geometry = kv_geometry(mc, config.block_size)
        self.layout = KVLayout(self.geometry, config.kv_layout)
        self.kv_tensors = self.layout.allocate(config.num_gpu_blocks, device="cpu")
        self.kv_caches = [
            self.layout.layer_kv(self.kv_tensors, layer) for layer in range(mc.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}
        # Filled by each execute() only when config.record_logits (verification).
        self.record_logits = config.record_logits
        self.last_logits: dict[str, torch.Tensor] = {}

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.vocab_size)

    @property
    def max_position(self) -> int:
        return int(self.model_config.max_position)

    @torch.inference_mode()
    def execute(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, int]:
        """Run one step; returns the sampled token of each request that reached its end."""
        from kvoffload.engine.attention import AttentionMetadata
        from kvoffload.engine.sampling import sample

        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampled_reqs: list[Request] = []
        for req, n in zip(requests, num_tokens):
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            block_ids = [b.block_id for b in req.blocks]
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            starts.append(starts[-1] + n)
            seq_lens.append(start + n)
            tables.append(block_ids)
            if start + n == req.num_tokens:
                logits_rows.append(starts[-1] - 1)
                sampled_reqs.append(req)
        meta = AttentionMetadata.build(
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            block_size=bs,
        )
        logits = self.model(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.long),
        )
        out: dict[str, int] = {}
        for row, req in enumerate(sampled_reqs):
            out[req.req_id] = sample(logits[row], req.sampling, self._generator(req))
        if self.record_logits:
            # Copies: the step's logits tensor is reused memory once it is freed.
            self.last_logits = {
                req.req_id: logits[row].clone() for row, req in enumerate(sampled_reqs)
            }
        return out

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.sampling.temperature == 0:
            return None
        gen = self.generators.get(req.req_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(
                req.sampling.seed if req.sampling.seed is not None else self.config.seed
            )
            self.generators[req.req_id] = gen
        return gen

    def release(self, req_id: str) -> None:
        self.generators.pop(req_id, None)
