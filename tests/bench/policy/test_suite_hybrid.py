"""The suite's hybrid family: points the leave-one-family-out choice sees (no vLLM needed)."""

from __future__ import annotations

import math

from kvoffload.bench.policy import suite, suite_hybrid
from kvoffload.bench.policy.suite import Point
from kvoffload.offload.chunk_units import GroupLayout
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY


def _fake_vllm(
    slots: int, prompts: list[list[int]], layout: tuple[GroupLayout, ...]
) -> dict[str, float]:
    return {"vllm:lru": 0.1, "vllm:arc": 0.2}


def test_hybrid_points_cover_every_layout_and_size_for_every_candidate() -> None:
    steps: list[str] = []
    policies = [DEFAULT_CACHE_POLICY, "lru", "AdmitLRUPolicy"]
    points = suite_hybrid.run_hybrid(policies, (), "tiny", steps.append, _fake_vllm)
    n = len(suite_hybrid.LAYOUTS) * len(suite_hybrid.CAPACITIES) * 2  # two seeds
    assert len(points) == n and len(steps) == suite_hybrid.steps("tiny", len(policies))
    assert {p.family for p in points} == {"hybrid"}
    assert {p.trace.split("/")[1] for p in points} == set(suite_hybrid.LAYOUTS)
    for p in points:
        assert set(p.hit) == set(policies) and all(0.0 <= h <= 1.0 for h in p.hit.values())
        assert math.isnan(p.belady) and p.vllm_best == 0.2
    # Chunk units at work: the default serves hits on the long conversations.
    assert max(p.hit[DEFAULT_CACHE_POLICY] for p in points) > 0.2


def test_the_held_out_choice_sees_the_hybrid_family() -> None:
    plain = Point("chat", "chat/1", "5%", 10, 0.5, {"vllm:lru": 0.3}, {"a": 0.31, "b": 0.30})
    hybrid = Point("hybrid", "hybrid/2g-w128", "5%", 10, math.nan, {"vllm:lru": 0.3})
    hybrid.hit.update({"a": 0.20, "b": 0.29})
    held = {h.family: h for h in suite.leave_one_family_out([plain, hybrid], ["a", "b"], "a")}
    assert held["chat"].chosen == "b"  # picked on hybrid, where a loses 10 points
    assert held["hybrid"].chosen == "a"
    assert suite.worst_by_family([plain, hybrid], ["a", "b"])["hybrid"]["a"] < -9
