"""Model identity, and two models of one shape sharing a disk directory or a Redis server.

Two checkpoints of the same tiny shape but other weights hash their blocks
identically (block hashes cover tokens only), so a tier keyed without the
model would serve one model's KV to the other. Every answer is compared
against a run of the same model without the tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from kvoffload.engine.checkpoint import save_model
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.llm_engine import LLMEngine
from kvoffload.engine.model import build_model
from kvoffload.engine.model_config import ModelConfig
from kvoffload.engine.model_identity import (
    checkpoint_identity,
    engine_model_identity,
    named_model_identity,
    random_model_identity,
)
from kvoffload.engine.request import SamplingParams
from kvoffload.tiers.disk.store import DiskStoreMismatchError
from tests.conftest_redis import RedisServer, redis_server, redis_server_factory

__all__ = ["redis_server", "redis_server_factory"]

TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=1024,
)
BS = 8


@pytest.fixture(autouse=True)
def _private_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(tmp_path / "digest-cache"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return (
        save_model(build_model(TINY, seed=1), root / "a"),
        save_model(build_model(TINY, seed=2), root / "b"),
    )


def prompts() -> list[list[int]]:
    system = [(7 * i + 3) % 500 for i in range(32)]
    convs = [[(11 * i + 37 * c + 1) % 500 for i in range(16)] for c in range(3)]
    return [system + conv[: 8 * (t + 1)] + [c, t] for t in range(2) for c, conv in enumerate(convs)]


def run(model: Path, **kw: object) -> tuple[list[list[int]], dict[str, int]]:
    cfg = EngineConfig(
        model_path=str(model),
        block_size=BS,
        num_gpu_blocks=12,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_cpu_blocks=8,
        **kw,  # type: ignore[arg-type]
    )
    engine = LLMEngine(cfg)
    try:
        outs = []
        for p in prompts():  # one at a time: the GPU and CPU tiers churn
            outs += engine.generate([p], SamplingParams(max_tokens=3))
        engine.drain()
        by_medium: dict[str, int] = {}
        if engine.offload is not None:
            by_medium = dict(getattr(engine.offload.manager, "hit_blocks_by_medium", dict)())
        return outs, by_medium
    finally:
        engine.close()


# -- identities -------------------------------------------------------------------------


def test_checkpoint_identity_follows_the_weights(checkpoints: tuple[Path, Path]) -> None:
    a, b = checkpoints
    ia, ib = checkpoint_identity(a), checkpoint_identity(b)
    assert ia.startswith("ckpt:") and ib.startswith("ckpt:") and ia != ib
    assert checkpoint_identity(a, use_cache=False) == ia


def test_checkpoint_digest_is_cached_by_path_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import kvoffload.engine.model_identity as mi

    ckpt = save_model(build_model(TINY, seed=3), tmp_path / "c")
    first = checkpoint_identity(ckpt)
    calls: list[int] = []
    real = mi._hash_files

    def counting(files: list[Path]) -> str:
        calls.append(len(files))
        return real(files)

    monkeypatch.setattr(mi, "_hash_files", counting)
    assert checkpoint_identity(ckpt) == first and calls == []  # a restart re-reads nothing
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # other weights, same size
    weights.write_bytes(bytes(data))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    changed = checkpoint_identity(ckpt)
    assert calls and changed != first


def test_unwritable_cache_still_gives_the_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoints: tuple[Path, Path]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(blocker / "sub"))
    assert checkpoint_identity(checkpoints[0]) == checkpoint_identity(
        checkpoints[0], use_cache=False
    )


def test_random_and_named_identities() -> None:
    assert random_model_identity(TINY, 0) != random_model_identity(TINY, 1)
    other = ModelConfig(**{**TINY.to_dict(), "rope_theta": 500000.0})
    assert random_model_identity(TINY, 0) != random_model_identity(other, 0)
    assert random_model_identity(TINY, 0) == engine_model_identity(None, TINY, 0)
    n = named_model_identity("org/model;x=1", "main")
    assert n.startswith("name:org/model") and ";" not in n and n.count("=") == 0
    assert n != named_model_identity("org/model;x=1", "v2")
    with pytest.raises(ValueError):
        named_model_identity("")


# -- two models, one tier -----------------------------------------------------------------


def test_two_models_never_share_a_disk_directory(
    tmp_path: Path, checkpoints: tuple[Path, Path]
) -> None:
    a, b = checkpoints
    ref_a, _ = run(a, store_mode="off")
    disk = tmp_path / "disk"
    outs, _ = run(a, disk_dir=str(disk), num_disk_blocks=64)
    assert outs == ref_a
    with pytest.raises(DiskStoreMismatchError, match=r"model: 'ckpt:[0-9a-f]+' vs 'ckpt:") as e:
        run(b, disk_dir=str(disk), num_disk_blocks=64)
    assert "\n" not in str(e.value)
    outs, by_medium = run(a, disk_dir=str(disk), num_disk_blocks=64)  # A again: reuses it
    assert outs == ref_a and by_medium.get("DISK", 0) > 0


def test_two_models_sharing_one_redis_never_change_an_answer(
    redis_server: RedisServer, checkpoints: tuple[Path, Path]
) -> None:
    a, b = checkpoints
    ref_a, _ = run(a, store_mode="off")
    ref_b, _ = run(b, store_mode="off")
    assert ref_a != ref_b  # the models differ, so borrowed KV would show
    outs, _ = run(a, redis_url=redis_server.url)
    assert outs == ref_a
    outs, _ = run(b, redis_url=redis_server.url)
    assert outs == ref_b
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        prefixes = {tuple(k.split(b":")[:3]) for k in client.scan_iter(match=b"kvo:*")}
    finally:
        client.close()
    assert len(prefixes) == 2  # one namespace per model on the one server
    outs, by_medium = run(a, redis_url=redis_server.url)
    assert outs == ref_a and by_medium.get("REMOTE", 0) > 0  # A's own blocks are found


def test_two_random_models_of_one_shape_sharing_one_redis(redis_server: RedisServer) -> None:
    # The embedded model: its identity is its config and seed.
    kw = {"block_size": BS, "num_gpu_blocks": 12, "max_num_seqs": 2}
    kw |= {"max_num_batched_tokens": 64, "num_cpu_blocks": 8}
    ps = prompts()[:3]
    sp = SamplingParams(max_tokens=2)

    def go(seed: int, **extra: object) -> list[list[int]]:
        with LLMEngine(EngineConfig(seed=seed, **kw, **extra)) as engine:  # type: ignore[arg-type]
            outs = [engine.generate([p], sp)[0] for p in ps]
            engine.drain()
            return outs

    ref1 = go(1, store_mode="off")
    go(0, redis_url=redis_server.url)
    assert go(1, redis_url=redis_server.url) == ref1
