"""The extra sliding-window stores are valued as the issue asks, at equal bytes.

- Store rules (``hybrid_windows``): vLLM's keeps the window before the last prompt token
  only; the default adds windows at junctions and every ``every`` chunks, a superset.
- In kvoffload's CPU tier (the chunk-unit policy) an extra window no boundary reaches is
  dead: evicted before any chunk a hit needs; a lookup that parts there revives it.
- On the replay at equal bytes the default serves at least what vLLM's rule does.
"""

from __future__ import annotations

from kvoffload.bench.policy import hybrid_replay as hr
from kvoffload.bench.policy.hybrid_windows import VLLM, Junctions, StoreRule, store_keys
from kvoffload.bench.policy.hybrid_windows_bench import default_rule
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.base import make_offload_key
from kvoffload.offload.chunk_units import GroupLayout

T = 64
LAYOUT = (GroupLayout(tokens_per_chunk=T), GroupLayout("sliding_window", 128, T))
WINDOWS = [None, 2]


def _keys(prompt: list[int]) -> list[list[bytes]]:
    return [[make_offload_key(c.to_bytes(8, "big"), g) for c in prompt] for g in range(2)]


def test_the_default_stores_a_superset_of_vllms_rule() -> None:
    prompt = list(range(40))
    junctions = Junctions()
    junctions.add(prompt[9])
    for hit in (0, 5, 20):
        vllm = store_keys(VLLM, _keys(prompt), WINDOWS, prompt, hit, T, junctions)
        mine = store_keys(StoreRule("windows", True, 8), _keys(prompt), WINDOWS, prompt, hit, T,
                          junctions)  # fmt: skip
        assert set(vllm) <= set(mine)
        sw = sorted(int.from_bytes(k[:8], "big") for k in mine if k[-1] == 1)
        # vLLM's window before chunk 39, the junction's before 10, one before every 8th.
        want = {37, 38} | ({8, 9} if hit <= 8 else set())
        want |= {c for b in range(8, 41, 8) if b > hit for c in (b - 2, b - 1) if c >= hit}
        assert sw == sorted(c for c in want if c >= hit)


def test_an_extra_window_no_boundary_reaches_is_evicted_first_and_revived_by_a_lookup() -> None:
    m = CPUOffloadingManager(200, group_layout=LAYOUT)
    units = m.policy
    prompt = list(range(40))
    keys = _keys(prompt)
    stored = store_keys(StoreRule("windows", False, 8), keys, WINDOWS, prompt, 0, T, Junctions())
    out = m.prepare_store(stored)
    assert out is not None
    m.complete_store(out.keys_to_store)
    extra = [keys[1][c] for c in (6, 7, 14, 15)]  # the windows before chunks 8 and 16
    assert all(units.is_dead(k) for k in extra)  # type: ignore[attr-defined]
    assert not units.is_dead(keys[1][38])  # type: ignore[attr-defined]
    # A request that parts after chunk 15: its lookup shows the boundary, the window lives.
    other = [*prompt[:16], *range(100, 110)]
    assert m.lookup(_keys(other)[0]) == 16
    assert not any(units.is_dead(k) for k in extra[2:])  # type: ignore[attr-defined]
    assert all(units.is_dead(k) for k in extra[:2])  # type: ignore[attr-defined]
    # Room for a new store comes from the dead windows first.
    fresh = [make_offload_key((1000 + i).to_bytes(8, "big"), 0) for i in range(200 - len(stored))]
    out = m.prepare_store([*fresh, make_offload_key(b"x" * 8, 0)])
    assert out is not None and sorted(out.evicted_keys) == sorted(extra[:1])


def test_at_equal_bytes_the_default_serves_at_least_vllms_rule() -> None:
    prompts = hr.long_prompts(40, 4096, T, seed=1)
    layout = hr.layouts(T)["2g-w128"]
    unique = len({c for p in prompts for c in p}) * len(layout)
    for frac in (0.05, 0.2):
        slots = round(frac * unique)
        hits = {
            name: hr.replay(
                hr._side("kvoffload:default+units", slots, layout), name, prompts, layout, rule
            ).hit_rate
            for name, rule in (("off", VLLM), ("default", default_rule(layout)))
        }
        assert hits["default"] >= hits["off"], (frac, hits)
    assert default_rule(layout) == StoreRule("windows", junctions=True, every=32)
