"""The tier fingerprint: every field that decides a slot's bytes, and readable differences."""

from __future__ import annotations

import pytest
import torch

from kvoffload.tiers.identity import (
    FINGERPRINT_FIELDS,
    fingerprint_diff,
    parse_fingerprint,
    tier_fingerprint,
)
from kvoffload.tiers.redis.store import namespace_prefix
from kvoffload.transfer.layout import KVGeometry, KVLayout
from tests.conftest_redis import RedisServer
from tests.tiers.tier_rig import Rig, tkey

G = KVGeometry(num_layers=2, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.float16)
BASE = {
    "model_id": "ckpt:abc",
    "hash_fn": "xxhash64",
    "hash_seed": "0",
    "kv_quant": "none",
    "tp_rank": 0,
    "tp_size": 2,
}


def fp(layout: KVLayout | None = None, factor: int = 1, **kw: object) -> str:
    return tier_fingerprint(layout or KVLayout(G, "layer_first"), factor, **{**BASE, **kw})  # type: ignore[arg-type]


def test_fields_round_trip() -> None:
    f = parse_fingerprint(fp(model_id="vllm:org/m@main;kv_dtype=auto;hash=sha256"))
    assert tuple(f) == FINGERPRINT_FIELDS
    assert f["model"] == "vllm:org/m@main;kv_dtype=auto;hash=sha256"  # separators escaped
    assert f["dtype"] == "float16" and f["layout"] == "layer_first"
    assert parse_fingerprint(fp(hash_seed=None))["hash_seed"] == "random"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_id": "ckpt:def"}, "model"),
        ({"hash_fn": "sha256_cbor"}, "hash_fn"),
        ({"hash_seed": "1"}, "hash_seed"),
        ({"kv_quant": "fp8_e4m3"}, "kv_quant"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"tp_size": 4}, "tp_size"),
        ({"factor": 2}, "block_size_factor"),
        ({"layout": KVLayout(G, "cross_layer")}, "layout"),
    ],
)
def test_every_field_changes_the_fingerprint_and_the_prefix(
    change: dict[str, object], field: str
) -> None:
    a = fp()
    b = fp(**change)  # type: ignore[arg-type]
    assert a != b
    assert namespace_prefix("ns", 4096, a, "x") != namespace_prefix("ns", 4096, b, "x")
    (diff,) = fingerprint_diff(a, b)
    assert diff.startswith(f"{field}: ")


def test_geometry_fields_differ_readably() -> None:
    other = KVGeometry(num_layers=3, num_kv_heads=2, head_size=16, block_size=8, dtype="bfloat16")
    diff = fingerprint_diff(fp(), fp(KVLayout(other, "layer_first")))
    assert diff == [
        "layers: '2' vs '3'",
        "block_size: '4' vs '8'",
        "dtype: 'float16' vs 'bfloat16'",
    ]
    assert fingerprint_diff("opaque", "other") == ["fingerprint: 'opaque' vs 'other'"]
    assert fingerprint_diff(fp(), fp()) == []


def test_bad_parallel_position() -> None:
    with pytest.raises(ValueError, match="rank"):
        fp(tp_rank=2, tp_size=2)


def test_lower_tiers_need_a_model_identity() -> None:
    with pytest.raises(ValueError, match="model_id"):
        Rig(cpu_blocks=1, redis_url="redis://127.0.0.1:1/0", model_id="")


def test_two_models_on_one_redis_never_see_each_other(redis_server: RedisServer) -> None:
    a = Rig(cpu_blocks=1, redis_url=redis_server.url, model_id="model-a")
    b = Rig(cpu_blocks=1, redis_url=redis_server.url, model_id="model-b")
    a2 = Rig(cpu_blocks=1, redis_url=redis_server.url, model_id="model-a")
    try:
        for i in range(5):
            a.store([i])  # 0..3 written down
        assert b.m.lookup([tkey(i) for i in range(4)]) == 0
        a2.truth = a.truth
        assert a2.m.lookup([tkey(0)]) == 1 and a2.load([0]) == (1, True)
    finally:
        for r in (a, b, a2):
            r.close()
