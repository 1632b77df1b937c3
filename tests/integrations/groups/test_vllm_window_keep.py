"""``sliding_window_keep`` (``window_keep.py``) inside vLLM 0.33's real scheduler.

A sliding-window + full-attention model (vLLM's planner: two KV cache groups,
window 32 tokens, 16-token blocks). Three prompts share a prefix ``S`` of 7
full blocks and then part: ``S + A``, ``S + B``, ``S + C``; between them
unrelated prompts push everything out of the GPU tier, so every hit is
kvoffload's. vLLM stores the sliding-window group's tail at each prompt's
*end* only, so ``S + B`` and ``S + C`` find every full-attention chunk of
``S`` but no window ending there, and load nothing:

- off (``sliding_window_keep: false``): stores and hits are exactly vLLM's own
  ``CPUOffloadingSpec`` scheduler's on the same requests;
- the default (no key): junctions and a window every ``default_every`` tokens
  (16 windows: 512 tokens, past ``S``), so as with junctions alone;
- ``sliding_window_keep: true`` (junctions): ``S + B`` shows that prompts
  part after ``S``; it keeps the window ending there, so ``S + C`` hits all
  of ``S``;
- ``sliding_window_keep_every: 64``: a window every 64 tokens, so ``S + B``
  hits already (up to the last multiple of 64 in ``S``).

On: a superset of vLLM's stores, hits at least vLLM's, loaded bytes equal to
what each group's layers held.
"""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from kvoffload.integrations.vllm.groups.window_keep import (  # noqa: E402
    JunctionSet,
    WindowKeepConfig,
)
from kvoffload.integrations.vllm.settings import KVOffloadConfigError  # noqa: E402
from tests.integrations.vllm_groups_rig import (  # noqa: E402
    KVOFFLOAD_SPEC,
    STOCK,
    VLLM_CPU_SPEC,
    GroupsRig,
    full_spec,
    layer_specs,
    sliding_spec,
)
from tests.integrations.vllm_rig import BLOCK_SIZE, CONNECTOR  # noqa: E402

SPECS = layer_specs([sliding_spec(32), full_spec(), sliding_spec(32), full_spec()])
#: 7 full blocks shared, then each prompt its own 3 blocks and a partial one.
SHARED = list(range(1, 7 * BLOCK_SIZE + 1))
TAILS = {name: [base + j for j in range(3 * BLOCK_SIZE + 5)] for name, base in
         (("a", 3000), ("b", 4000), ("c", 5000))}  # fmt: skip


def _serve(rig: GroupsRig) -> dict[str, int]:
    """S+A, S+B, S+C, each after a flood; tokens each got from outside the GPU tier."""
    got: dict[str, int] = {}
    for n, (name, tail) in enumerate(TAILS.items()):
        rig.add(SHARED + tail, name)
        rig.run()
        for i in range(3):
            rig.add([20000 + 1000 * n + 200 * i + j for j in range(160)], f"flood{n}{i}")
            rig.run()
    for name in TAILS:
        got[name] = rig.first_computed[name]
    return got


def _keep_stats(rig: GroupsRig) -> Any:
    """The connector's ``WindowKeepStats``, or None where keeping is off."""
    keep = getattr(rig.scheduler.connector, "window_keep", None)
    return None if keep is None else keep.stats


def _external(rig: GroupsRig) -> dict[str, int]:
    return {name: n for name, n in rig.first_computed.items() if name in TAILS}


def _run(tmp_path: Path, name: str, keep: dict[str, Any] | None, instant: bool = False) -> Any:
    if keep is None:  # vLLM's own CPU spec (its worker needs CUDA: decisions only)
        extra: dict[str, Any] = {"cpu_bytes_to_use": 8 << 20, **VLLM_CPU_SPEC}
        rig = GroupsRig.build(tmp_path / name, SPECS, extra, STOCK, instant=True)
    else:
        extra = {"cpu_bytes": "8MiB", "sync_load_budget_bytes": 0, **keep}
        rig = GroupsRig.build(tmp_path / name, SPECS, extra, CONNECTOR, instant=instant)
    try:
        _serve(rig)
        return rig
    finally:
        rig.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GroupsRig]:
    tmp = tmp_path_factory.mktemp("window-keep")
    return {
        "vllm": _run(tmp, "vllm", None),
        "off": _run(tmp, "off", {"sliding_window_keep": False}),
        "default": _run(tmp, "default", {}),
        "junctions": _run(tmp, "junctions", {"sliding_window_keep": True}),
        "every": _run(tmp, "every", {"sliding_window_keep_every": 64}),
    }


def test_the_layout_has_a_sliding_window_group(runs: dict[str, GroupsRig]) -> None:
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in runs["off"].groups)
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec"]


def test_off_stores_and_hits_what_vllm_does(runs: dict[str, GroupsRig]) -> None:
    vllm, off = runs["vllm"], runs["off"]
    assert _keep_stats(off) is None
    assert sorted(off.stored_keys) == sorted(vllm.stored_keys)
    assert _external(off) == _external(vllm)
    # The failure being fixed: S+B and S+C share all of S and get nothing.
    assert _external(off)["b"] == _external(off)["c"] == 0


@pytest.mark.parametrize("name", ["junctions", "default"])
def test_junctions_make_the_third_prompt_hit_the_shared_prefix(
    runs: dict[str, GroupsRig], name: str
) -> None:
    vllm, on = runs["vllm"], runs[name]
    hits = _external(on)
    print(f"tokens from kvoffload ({name}): {hits}, vLLM: {_external(vllm)}")
    assert hits["b"] == 0  # nobody had parted at S yet
    assert hits["c"] == len(SHARED)
    assert set(vllm.stored_keys) <= set(on.stored_keys)
    extra = len(set(on.stored_keys) - set(vllm.stored_keys))
    stats = _keep_stats(on)
    print(f"{name}: {stats}; {extra} more chunk keys stored than vLLM")
    # One window (32 tokens = 2 blocks of 16) at the one junction.
    assert stats.junctions >= 1
    assert extra == 2


def test_every_makes_the_second_prompt_hit_too(runs: dict[str, GroupsRig]) -> None:
    vllm, on = runs["vllm"], runs["every"]
    hits = _external(on)
    print(f"tokens from kvoffload every 64: {hits}, vLLM: {_external(vllm)}")
    # 112 shared tokens: the last multiple of 64 inside S.
    assert hits["b"] == hits["c"] == 64
    assert set(vllm.stored_keys) <= set(on.stored_keys)
    for name, n in _external(vllm).items():
        assert hits[name] >= n


def test_loaded_bytes_are_what_each_groups_layers_held(runs: dict[str, GroupsRig]) -> None:
    for name in ("off", "default", "junctions", "every"):
        rig = runs[name]
        assert not rig.mismatches, (name, rig.mismatches)
    assert runs["junctions"].blocks_verified > runs["off"].blocks_verified


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sliding_window_keep": "sometimes"}, "sliding_window_keep"),
        ({"sliding_window_keep_every": -32}, "sliding_window_keep_every"),
        ({"sliding_window_keep_every": "64"}, "sliding_window_keep_every"),
    ],
)
def test_bad_values_are_one_line_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(KVOffloadConfigError, match=match) as info:
        WindowKeepConfig.from_extra_config(extra)
    assert "\n" not in str(info.value)


def test_behind_vllms_stock_connector_the_keys_are_refused(tmp_path: Path) -> None:
    """vLLM's OffloadingConnector cannot add stores: the keys would be accepted and ignored."""
    extra = {"cpu_bytes": "8MiB", "sliding_window_keep": True, **KVOFFLOAD_SPEC}
    with pytest.raises(KVOffloadConfigError, match="need KVOffloadConnector") as info:
        rig = GroupsRig.build(tmp_path / "stock", SPECS, extra, STOCK, instant=True)
        rig.shutdown()
    assert "\n" not in str(info.value)


def test_config_values() -> None:
    assert WindowKeepConfig.from_extra_config({}).auto
    assert not WindowKeepConfig.from_extra_config({"sliding_window_keep": False}).enabled
    assert not WindowKeepConfig.from_extra_config({"sliding_window_keep": "off"}).enabled
    assert WindowKeepConfig.from_extra_config({"sliding_window_keep": "junctions"}).junctions
    assert WindowKeepConfig.from_extra_config({"sliding_window_keep": "true"}).junctions
    every = WindowKeepConfig.from_extra_config({"sliding_window_keep_every": 64})
    assert every.enabled and not every.junctions and every.every == 64


def test_junction_set_is_bounded_lru() -> None:
    js = JunctionSet(capacity=2)
    assert js.add(b"a") and js.add(b"b")
    assert not js.add(b"a")  # refreshed: b is now the oldest
    assert js.add(b"c")
    assert len(js) == 2 and b"a" in js and b"c" in js and b"b" not in js
