"""``window_keep``'s default (extra windows on where the CPU tier values them) and the
contracts its docstring states, against a stand-in scheduler (no vLLM needed).

- No key: junctions and a window every ``default_every`` tokens, installed only where the
  CPU tier is kvoffload's chunk-unit policy; elsewhere off, with the reason logged.
- Explicit keys are honoured wherever the tier is; behind vLLM's stock connector only an
  explicit request for extra stores is refused (the default stays vLLM's stores there).
- A boundary only adds blocks to vLLM's mask (a superset of vLLM's stores).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.integrations.vllm.groups.window_keep import (
    DEFAULT_EVERY_WINDOWS,
    WindowKeep,
    WindowKeepConfig,
    auto_off_reason,
    check_reachable,
    default_every,
    install_window_keep,
)
from kvoffload.integrations.vllm.scheduler.class_managers import ClassedCPUManager
from kvoffload.integrations.vllm.settings import KVOffloadConfigError
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.chunk_units import GroupLayout
from tests.integrations.groups.window_stand import TPC, window_mask
from tests.integrations.groups.window_stand import Stand as WindowStand

WINDOW = 48  # tokens: a hit needs the 2 chunks before its boundary
LAYOUT = [GroupLayout(tokens_per_chunk=TPC), GroupLayout("sliding_window", WINDOW, TPC)]


@dataclass
class Stand(WindowStand):
    window: int = WINDOW


def _units_tier() -> Any:
    return SimpleNamespace(cpu=CPUOffloadingManager(64, group_layout=LAYOUT))


def test_no_key_is_the_default_junctions_and_every_default_every_tokens() -> None:
    config = WindowKeepConfig.from_extra_config({})
    assert config.auto and config.junctions and config.every is None and config.enabled
    auto = WindowKeepConfig.from_extra_config({"sliding_window_keep": "auto"})
    assert auto == config
    keep = install_window_keep(Stand(_units_tier()), {})
    assert keep is not None and keep.config.junctions
    assert keep.config.every == default_every(WINDOW, TPC) == DEFAULT_EVERY_WINDOWS * WINDOW


def test_default_every_is_whole_chunks_of_that_many_windows() -> None:
    assert default_every(1024, 256) == DEFAULT_EVERY_WINDOWS * 1024
    assert default_every(48, 32) % 32 == 0 and default_every(48, 32) >= DEFAULT_EVERY_WINDOWS * 48
    assert default_every(16, 64) == DEFAULT_EVERY_WINDOWS * 64  # at least a chunk per window
    assert default_every(0, 32) == 0


@pytest.mark.parametrize(
    ("manager", "why"),
    [
        (SimpleNamespace(cpu=CPUOffloadingManager(64)), "does not rank chunks as units"),
        (
            SimpleNamespace(
                cpu=ClassedCPUManager([CPUOffloadingManager(8), CPUOffloadingManager(8)], [0, 1])
            ),
            "ranks keys one by one",
        ),
        (SimpleNamespace(), "ranks keys one by one"),  # vLLM's tiering manager: no .cpu
    ],
)
def test_the_default_is_off_where_the_tier_cannot_value_extra_windows(
    manager: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    sched = Stand(manager)
    before = (sched._maximal_prefix_lookup, sched._reachable_store_block_mask)
    with caplog.at_level(logging.INFO, logger="kvoffload"):  # the log bridge may own its level
        assert install_window_keep(sched, {}) is None
    assert (sched._maximal_prefix_lookup, sched._reachable_store_block_mask) == before
    reason = auto_off_reason(sched)
    assert reason is not None and why in reason
    assert any(why in r.getMessage() for r in caplog.records)
    # An explicit request is honoured there all the same.
    assert install_window_keep(Stand(manager), {"sliding_window_keep": True}) is not None


def test_the_default_is_off_without_a_sliding_window_group() -> None:
    sched = Stand(_units_tier(), _sliding_window_groups=())
    assert auto_off_reason(sched) == "no sliding-window group"
    assert install_window_keep(sched, {}) is None


def test_explicit_keys_keep_their_meaning() -> None:
    assert WindowKeepConfig.from_extra_config({"sliding_window_keep": False}) == WindowKeepConfig()
    every = WindowKeepConfig.from_extra_config({"sliding_window_keep_every": 64})
    assert every == WindowKeepConfig(junctions=False, every=64)
    both = WindowKeepConfig.from_extra_config({"sliding_window_keep": True})
    assert both == WindowKeepConfig(junctions=True, every=0)
    assert install_window_keep(Stand(_units_tier()), {"sliding_window_keep": "off"}) is None


def test_behind_the_stock_connector_only_an_explicit_request_is_refused() -> None:
    for quiet in ({}, {"sliding_window_keep": "auto"}, {"sliding_window_keep": False}):
        check_reachable(quiet)  # vLLM's stores, exactly
    for loud in ({"sliding_window_keep": True}, {"sliding_window_keep_every": 64}):
        with pytest.raises(KVOffloadConfigError, match="need KVOffloadConnector") as info:
            check_reachable(loud)
        assert "\n" not in str(info.value)


def test_a_store_mask_is_always_a_superset_of_vllms() -> None:
    rng = random.Random(5)
    for _ in range(200):
        sched = Stand(_units_tier())
        junctions = rng.random() < 0.5
        keep = WindowKeep(WindowKeepConfig(junctions=junctions, every=TPC * rng.randint(0, 4)))
        keep.install(sched)
        n = rng.randint(1, 12)
        fa = [f"k{rng.randint(0, 20)}".encode() for _ in range(n)]
        sched.stored.update(rng.sample(fa, rng.randint(0, n)))
        sched._maximal_prefix_lookup(iter(fa), None, None, sched.config.kv_group_configs[0], 0)
        start = rng.randint(0, n - 1)
        base_bounds = tuple(sorted(rng.sample(range(1, (n + 2) * TPC), rng.randint(0, 2))))
        req_status = SimpleNamespace(  # noqa: F841 - read from this frame by WindowKeep
            group_states=[SimpleNamespace(offload_keys=fa), None]
        )
        sw = sched.config.kv_group_configs[1]
        got = sched._reachable_store_block_mask(sw, start, n, None, base_bounds)
        base = window_mask(start, n, base_bounds, WINDOW)
        assert got is not None and len(got) == len(base)
        assert all(g or not b for g, b in zip(got, base))
