"""The offline replays ask the tier which keys to store, as kvoffload's connector does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvoffload.bench.policy.mooncake import MooncakeRequest, replay_mooncake
from kvoffload.bench.policy.replay import replay
from kvoffload.bench.policy.traces import generate, trace_keys
from kvoffload.offload import CPUOffloadingManager, OffloadKey


def _decline_all(self: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> list[bool]:
    return [self.is_stored(k) for k in keys]


def test_offload_replay_offers_only_admitted_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = trace_keys(generate("chat", 120, seed=3))
    assert replay(trace, "lru", 200).hit_blocks > 0
    monkeypatch.setattr(CPUOffloadingManager, "admit", _decline_all)
    assert replay(trace, "lru", 200).hit_blocks == 0  # nothing admitted, nothing stored
    assert replay(trace, "lru", 200, admission=False).hit_blocks > 0


def test_offload_replay_with_admission_keeps_more_at_one_percent() -> None:
    trace = trace_keys(generate("agent", 600, seed=11))
    unique = len({k for ks in trace for k in ks})
    cap = max(8, unique // 100)
    asked = replay(trace, "queue_arms", cap).hit_blocks
    assert asked >= replay(trace, "queue_arms", cap, admission=False).hit_blocks


def test_mooncake_replay_offers_only_admitted_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [
        MooncakeRequest(float(i), 512 * 4, 8, [i % 3 * 10 + j for j in range(4)]) for i in range(12)
    ]
    kw = dict(num_gpu_blocks=5, num_cpu_blocks=40, hold_requests=1)
    assert replay_mooncake(reqs, **kw).cpu_hit_blocks > 0  # type: ignore[arg-type]
    monkeypatch.setattr(CPUOffloadingManager, "admit", _decline_all)
    res = replay_mooncake(reqs, **kw)  # type: ignore[arg-type]
    assert res.cpu_hit_blocks == 0 and res.blocks_stored == 0
    assert res.stores_declined > 0
