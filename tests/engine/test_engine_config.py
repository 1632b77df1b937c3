"""EngineConfig: the fields other layers read are validated up front."""

import pytest

from kvoffload.engine import EngineConfig, LLMEngine
from kvoffload.engine.threads import (
    DEFAULT_NUM_THREADS,
    apply_thread_policy,
    default_wait_policy_env,
)


def test_defaults_follow_vllm() -> None:
    cfg = EngineConfig()
    assert cfg.hash_seed is None and cfg.events_format == "vllm"
    assert cfg.record_logits is False and cfg.num_threads is None


@pytest.mark.parametrize(
    "kw",
    [{"events_format": "json"}, {"hash_seed": 0}, {"num_threads": 0}, {"num_threads": True}],
)
def test_bad_values_are_value_errors(kw) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        EngineConfig(**kw)


def test_hash_seed_changes_every_block_hash() -> None:
    prompt = list(range(40))
    hashes = []
    for seed in ("1", "2", "1"):
        engine = LLMEngine(EngineConfig(block_size=8, store_mode="off", hash_seed=seed))
        try:
            engine.add_request(prompt, req_id="r")
            hashes.append(list(engine._requests["r"].block_hashes))
        finally:
            engine.close()
    assert hashes[0] == hashes[2]
    assert not set(hashes[0]) & set(hashes[1])


def test_thread_policy() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        assert apply_thread_policy(None) == DEFAULT_NUM_THREADS == torch.get_num_threads()
        assert apply_thread_policy(1) == 1 == torch.get_num_threads()
        with pytest.raises(ValueError):
            apply_thread_policy(0)
    finally:
        torch.set_num_threads(before)
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    default_wait_policy_env(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice wins
    env = {}
    default_wait_policy_env(env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
