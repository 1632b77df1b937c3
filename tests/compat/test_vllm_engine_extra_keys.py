"""The reference engine's salted and LoRA requests: hashes and GPU events as vLLM's.

Four requests share one prompt: plain, salted, LoRA, LoRA and salted. Every
GPU ``BlockStored`` the engine publishes must name blocks of vLLM 0.33's own
chain for that request (``get_request_block_hasher`` over a real
``vllm.v1.request.Request`` with the same ``LoRARequest`` and ``cache_salt``),
and carry, per block, what vLLM's block pool publishes there:
``to_event_extra_keys`` of ``generate_block_hash_extra_keys``. A salt or LoRA
path that does not reach the hasher, or a salt that does not reach the block
pool, fails here.
"""

from tests.vllm_required import need_vllm

need_vllm()

from typing import Any  # noqa: E402

import pytest  # noqa: E402
from vllm import SamplingParams as VllmSamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name as vllm_hash_fn  # noqa: E402
from vllm.v1.core import kv_cache_utils as vku  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kvoffload.events import BlockStored  # noqa: E402
from tests.events.published import record_published  # noqa: E402

BLOCK_SIZE = 8
PROMPT = [(11 * i + 5) % 400 for i in range(5 * BLOCK_SIZE + 3)]
# (name, lora (name, id, path) or None, salt or None)
VARIANTS: list[tuple[str, tuple[str, int, str] | None, str | None]] = [
    ("plain", None, None),
    ("salted", None, "tenant-1"),
    ("lora", ("adapter-a", 7, "/models/lora/a"), None),
    ("lora+salt", ("adapter-b", 9, "hf://org/adapter-b"), "tenant-2"),
]


def _vllm_blocks(
    tokens: list[int], lora: tuple[str, int, str] | None, salt: str | None
) -> list[tuple[bytes, Any]]:
    """(hash, event extra keys) of each full block, as vLLM 0.33 computes and publishes them."""
    req = VllmRequest(
        "r",
        list(tokens),
        VllmSamplingParams(max_tokens=1),
        None,
        lora_request=LoRARequest(*lora) if lora else None,
        cache_salt=salt,
        block_hasher=vku.get_request_block_hasher(BLOCK_SIZE, vllm_hash_fn("sha256")),
    )
    n = len(req.block_hashes)
    extra = vku.to_event_extra_keys(
        [
            vku.generate_block_hash_extra_keys(req, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, 0)[0]
            for i in range(n)
        ]
    )
    assert extra is not None
    return list(zip(req.block_hashes, extra, strict=True))


def test_salted_and_lora_requests_publish_vllms_hashes_and_extra_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Neither side seeded: sha256 chains start from vLLM's fixed default.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vku.init_none_hash(vllm_hash_fn("sha256"))
    engine = LLMEngine(
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            hash_fn="sha256",
            events_endpoint="tcp://127.0.0.1:*",
        )
    )
    published = record_published(engine)
    outputs: dict[str, list[int]] = {}
    try:
        for name, lora, salt in VARIANTS:
            engine.add_request(
                PROMPT,
                SamplingParams(max_tokens=BLOCK_SIZE + 2),
                req_id=name,
                lora_name=lora[0] if lora else None,
                lora_path=lora[2] if lora else None,
                cache_salt=salt,
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.req_id] = out.output_token_ids
    finally:
        engine.close()

    # Each block of each request: where it is in vLLM's chain of that request.
    where: dict[bytes, tuple[str, int, Any]] = {}
    for name, lora, salt in VARIANTS:
        for i, (block_hash, extra) in enumerate(_vllm_blocks(PROMPT + outputs[name], lora, salt)):
            assert block_hash not in where, "the variants' chains must differ"
            where[block_hash] = (name, i, extra)
    stored = [e for e in published if isinstance(e, BlockStored) and e.medium == "GPU"]
    seen: dict[str, set[int]] = {name: set() for name, _, _ in VARIANTS}
    for event in stored:
        assert event.extra_keys is not None
        assert len(event.extra_keys) == len(event.block_hashes)
        for block_hash, extra in zip(event.block_hashes, event.extra_keys, strict=True):
            assert block_hash in where, "a GPU block hash that vLLM would not compute"
            name, i, want = where[block_hash]
            assert extra == want, (name, i)
            seen[name].add(i)
        lora = dict((n, lo) for n, lo, _ in VARIANTS)[where[event.block_hashes[0]][0]]
        assert event.lora_name == (lora[0] if lora else None)
    # Every block whose KV was computed is published: the prompt's and the
    # generated ones (the last output token's KV is never computed).
    for name, _, _ in VARIANTS:
        computed = len(PROMPT) + len(outputs[name]) - 1
        assert seen[name] == set(range(computed // BLOCK_SIZE)), name
    # The salt is in the first block's keys only, the LoRA name in every block's.
    assert where[next(h for h, w in where.items() if w[:2] == ("lora+salt", 0))][2] == (
        "adapter-b",
        "tenant-2",
    )
