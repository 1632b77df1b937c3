"""The vLLM tiers' identity fingerprint folds in everything that decides a row's bytes.

Issue 32, contract a: with the KV dtype left out of ``tier_identity`` every
test passed, yet a tier written by a float16 engine would serve a bfloat16
engine of the same geometry (same row bytes). Here each field that decides
the bytes (model and revision, KV dtype, cache layout, canonical format,
KV cache groups, chunking, row size, hash function and seed, parallel
layout) is changed alone on a real vLLM ``OffloadingConfig``, and the
fingerprint (and the digest that names the disk directory and the Redis
namespace) must change with it. The rank must not change it: a row holds
every rank's shard.
"""

from tests.vllm_required import need_vllm

need_vllm()

import dataclasses  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import vllm.config  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)

from kvoffload.hashing.block_hash import SEED_ENV_VAR  # noqa: E402
from kvoffload.integrations.vllm.tiers.identity import identity_digest, tier_identity  # noqa: E402
from tests.integrations.vllm_tier_rig import parallel_config  # noqa: E402

ROW_BYTES = 1 << 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _config(**changes: Any) -> OffloadingConfig:
    """A TP=2 engine's config, with ``changes`` as ``section__field=value`` (or a top field)."""
    sections: dict[str, Any] = {
        "model": OffloadingModelConfig(name="org/tiny", dtype="float16"),
        "cache": OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        "parallel": parallel_config(2),
    }
    top: dict[str, Any] = {
        "groups": (OffloadingGroupConfig(tokens_per_block=32, layer_names=LAYERS, group_id=0),),
        "worker_kv_bytes_per_block": ROW_BYTES // 2,
        "enable_kv_cache_events": False,
        "extra_config": {},
        "engine_id": "engine-a",
        "replicated_layout": False,
        "canonical_layout": False,
        "kv_cache_layout": "NHD",
    }
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            sections[section] = dataclasses.replace(sections[section], **{name: value})
        else:
            top[key] = value
    return OffloadingConfig(**top, **sections)


def _engine(monkeypatch: pytest.MonkeyPatch, revision: str | None, hash_algo: str) -> None:
    """vLLM's current engine config, as the fingerprint reads it (revision, hash function)."""
    current = SimpleNamespace(
        model_config=SimpleNamespace(revision=revision),
        cache_config=SimpleNamespace(prefix_caching_hash_algo=hash_algo),
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)


def _fingerprint(
    monkeypatch: pytest.MonkeyPatch,
    *,
    revision: str | None = "r1",
    hash_algo: str = "sha256",
    seed: str = "7",
    row_bytes: int = ROW_BYTES,
    model_revision: str | None = None,
    **changes: Any,
) -> str:
    _engine(monkeypatch, revision, hash_algo)
    monkeypatch.setenv(SEED_ENV_VAR, seed)
    spec = SimpleNamespace(config=_config(**changes))
    return tier_identity(spec, row_bytes, model_revision)  # type: ignore[arg-type]


def _group(tokens: int = 32, layers: tuple[str, ...] = LAYERS, gid: int = 0, **kw: Any) -> Any:
    return OffloadingGroupConfig(tokens_per_block=tokens, layer_names=layers, group_id=gid, **kw)


SWA_LAYERS = ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")

#: (what changes, the keyword arguments of ``_fingerprint`` that change it).
CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("model name", {"model__name": "org/other"}),
    ("model revision (engine)", {"revision": "r2"}),
    ("model revision (tier key)", {"model_revision": "r9"}),
    ("KV dtype", {"model__dtype": "bfloat16"}),
    ("KV dtype (fp8)", {"model__dtype": "fp8_e4m3"}),
    ("cache layout", {"kv_cache_layout": "HND"}),
    ("canonical layout", {"canonical_layout": True}),
    ("tokens per block", {"groups": (_group(tokens=64),)}),
    ("layers of the group", {"groups": (_group(layers=LAYERS[:1]),)}),
    ("layer names", {"groups": (_group(layers=("a.0", "a.1")),)}),
    ("a second group", {"groups": (_group(), _group(layers=SWA_LAYERS, gid=1))}),
    (
        "group order",
        {"groups": (_group(layers=SWA_LAYERS, gid=0), _group(layers=LAYERS, gid=1))},
    ),
    ("tokens per hash", {"cache__tokens_per_hash": 16}),
    ("blocks per chunk", {"cache__blocks_per_chunk": 2}),
    ("row bytes", {"row_bytes": 2 * ROW_BYTES}),
    ("hash function", {"hash_algo": "xxhash"}),
    ("hash seed", {"seed": "8"}),
    ("world size", {"parallel__world_size": 4}),
    ("tensor parallel", {"parallel__tp_size": 1}),
    ("pipeline parallel", {"parallel__pp_size": 2}),
    ("prefill context parallel", {"parallel__pcp_size": 2}),
    ("decode context parallel", {"parallel__dcp_size": 2}),
    ("parallelism-agnostic rows", {"parallel__is_parallelism_agnostic": True}),
    ("replicated layout", {"replicated_layout": True}),
]


@pytest.mark.parametrize(("what", "change"), CHANGES, ids=[c[0] for c in CHANGES])
def test_each_field_that_decides_the_bytes_changes_the_fingerprint(
    monkeypatch: pytest.MonkeyPatch, what: str, change: dict[str, Any]
) -> None:
    base = _fingerprint(monkeypatch)
    changed = _fingerprint(monkeypatch, **change)
    assert changed != base, f"{what} is not in the tier identity"
    assert identity_digest(changed) != identity_digest(base)


def test_the_window_of_a_sliding_window_group_changes_the_fingerprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    full = (_group(), _group(layers=SWA_LAYERS, gid=1))
    fields = {f.name for f in dataclasses.fields(OffloadingGroupConfig)}
    if "sliding_window_size_in_chunks" not in fields:  # pragma: no cover - 0.32's config
        pytest.skip("this vLLM's OffloadingGroupConfig has no window")
    windowed = (_group(), _group(layers=SWA_LAYERS, gid=1, sliding_window_size_in_chunks=4))
    wider = (_group(), _group(layers=SWA_LAYERS, gid=1, sliding_window_size_in_chunks=8))
    prints = {_fingerprint(monkeypatch, groups=g) for g in (full, windowed, wider)}
    assert len(prints) == 3


def test_what_does_not_decide_the_bytes_leaves_it_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank, the engine id and the DP replica index: a row holds every rank's shard."""
    base = _fingerprint(monkeypatch)
    assert _fingerprint(monkeypatch, parallel__rank=1) == base
    assert _fingerprint(monkeypatch, engine_id="engine-b") == base
    assert _fingerprint(monkeypatch, enable_kv_cache_events=True) == base


def test_the_fingerprint_is_stable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same engine, same fingerprint: a restart on the same ``disk_dir`` reads its blocks."""
    assert _fingerprint(monkeypatch) == _fingerprint(monkeypatch)
