"""``window_keep``'s decisions against a stand-in scheduler (no vLLM needed).

The stand-in (``window_stand.Stand``) has what ``WindowKeep`` reads of vLLM's
``OffloadingConnectorScheduler``; here its window is one chunk, so its mask keeps, as
vLLM's sliding-window manager does with one-block windows, the block before each
reachable boundary.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.integrations.vllm.groups.window_keep import WindowKeep, WindowKeepConfig
from kvoffload.integrations.vllm.settings import KVOffloadConfigError
from tests.integrations.groups.window_stand import Stand


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def req_status(fa_keys: list[bytes]) -> Any:
    return SimpleNamespace(group_states=[SimpleNamespace(offload_keys=fa_keys), None])


def store_mask(sched: Stand, status: Any, start: int, end: int, boundaries=()) -> Any:
    """Calls the mask as vLLM's ``_build_store_jobs`` does: with ``req_status`` a local."""
    req_status = status  # noqa: F841 - read from this frame by WindowKeep
    return sched._reachable_store_block_mask(sched.config.kv_group_configs[1], start, end,
                                             None, boundaries)  # fmt: skip


def test_off_wraps_nothing() -> None:
    sched = Stand()
    before = (sched._maximal_prefix_lookup, sched._reachable_store_block_mask)
    WindowKeep(WindowKeepConfig()).install(sched)
    assert (sched._maximal_prefix_lookup, sched._reachable_store_block_mask) == before


def test_a_divergence_becomes_a_junction_kept_by_later_stores() -> None:
    sched = Stand()
    keep = WindowKeep(WindowKeepConfig(junctions=True))
    keep.install(sched)
    shared = keys("s", 5)
    sched.stored.update(shared)  # an earlier request stored S (5 chunks)
    mine = shared + keys("b", 3)
    fa = sched.config.kv_group_configs[0]
    assert sched._maximal_prefix_lookup(iter(mine), None, None, fa, 0) == 5
    assert keep.stats.junctions == 1 and shared[4] in keep.junctions
    # This request's store of chunks 0-7: vLLM's mask keeps its end (boundary 255);
    # the junction adds the window before chunk 5.
    mask = store_mask(sched, req_status(mine), 0, 8, (255,))
    assert [i for i, m in enumerate(mask) if m] == [4, 6]
    assert keep.stats.extra_chunks == 1
    # A full hit or a first miss is no divergence.
    assert sched._maximal_prefix_lookup(iter(shared), None, None, fa, 0) == 5
    assert sched._maximal_prefix_lookup(iter(keys("x", 3)), None, None, fa, 0) == 0
    assert keep.stats.junctions == 1


def test_every_n_tokens_and_only_inside_the_range() -> None:
    sched = Stand()
    keep = WindowKeep(WindowKeepConfig(every=64))
    keep.install(sched)
    status = req_status(keys("s", 8))
    assert [i for i, m in enumerate(store_mask(sched, status, 0, 4)) if m] == [1, 3]
    # Chunks 4-7: boundaries 192 and 256 (chunks 5 and 7); 128 ends before the range.
    assert [i for i, m in enumerate(store_mask(sched, status, 4, 8)) if m] == [1, 3]
    assert keep.stats.extra_chunks == 4


def test_dense_groups_and_unknown_callers_keep_vllms_mask(caplog) -> None:
    sched = Stand()
    keep = WindowKeep(WindowKeepConfig(every=64))
    keep.install(sched)
    fa = sched.config.kv_group_configs[0]
    assert sched._reachable_store_block_mask(fa, 0, 4, None, ()) is None
    # Called from a frame without ``req_status`` (a vLLM whose store path changed):
    # vLLM's own mask, and one warning.
    sw = sched.config.kv_group_configs[1]
    with caplog.at_level("WARNING"):
        assert sched._reachable_store_block_mask(sw, 0, 4, None, ()) == [False] * 4
        assert sched._reachable_store_block_mask(sw, 0, 4, None, ()) == [False] * 4
    assert sum("sliding_window_keep" in r.message for r in caplog.records) == 1
    assert keep.stats.extra_chunks == 0


def test_every_must_be_whole_chunks() -> None:
    with pytest.raises(KVOffloadConfigError, match="not a multiple of the offloaded chunk"):
        WindowKeep(WindowKeepConfig(every=48)).install(Stand())
