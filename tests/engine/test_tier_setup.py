"""The chain seed a persistent tier records for the engine's configuration."""

from __future__ import annotations

import pytest

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.tier_setup import _fingerprint_seed
from kvoffload.hashing.block_hash import SEED_ENV_VAR, resolve_none_hash_seed


def test_sha256_default_seed_is_recorded_not_called_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SEED_ENV_VAR, raising=False)
    unset = _fingerprint_seed(EngineConfig(hash_fn="sha256"))
    assert unset is not None and unset == resolve_none_hash_seed("sha256")
    # An engine naming the default explicitly shares the tier with one that left it unset.
    assert _fingerprint_seed(EngineConfig(hash_fn="sha256", hash_seed=unset)) == unset


def test_per_process_seed_is_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SEED_ENV_VAR, raising=False)
    assert _fingerprint_seed(EngineConfig(hash_fn="xxhash")) is None
    monkeypatch.setenv(SEED_ENV_VAR, "7")
    assert _fingerprint_seed(EngineConfig(hash_fn="xxhash")) == "7"
    assert _fingerprint_seed(EngineConfig(hash_fn="xxhash", hash_seed="9")) == "9"
