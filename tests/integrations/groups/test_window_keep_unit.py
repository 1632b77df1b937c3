"""``window_keep``'s decisions against a stand-in scheduler (no vLLM needed).

The stand-in has what ``WindowKeep`` reads of vLLM's ``OffloadingConnectorScheduler``:
``config.alignment_tokens`` / ``blocks_per_chunk`` / ``kv_group_configs``,
``_full_attention_groups``, ``_maximal_prefix_lookup`` and
``_reachable_store_block_mask``. Its mask keeps, as vLLM's sliding-window manager
does with one-block windows, the block before each reachable boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.integrations.vllm.groups.window_keep import WindowKeep, WindowKeepConfig
from kvoffload.integrations.vllm.settings import KVOffloadConfigError

TPC = 32  # tokens per chunk (one block per chunk)


@dataclass
class Group:
    group_idx: int
    kv_cache_spec: Any
    tokens_per_chunk: int = TPC


@dataclass
class Stand:
    """A scheduler with one full-attention group (0) and one sliding-window group (1)."""

    stored: set[bytes] = field(default_factory=set)
    config: Any = None
    _full_attention_groups: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        self.config = SimpleNamespace(
            alignment_tokens=TPC,
            blocks_per_chunk=1,
            kv_group_configs=[
                Group(0, SimpleNamespace()),
                Group(1, SimpleNamespace(sliding_window=TPC)),
            ],
        )

    def _maximal_prefix_lookup(self, keys, req_context, req, group_config, start) -> int:
        hit = 0
        for key in keys:
            if key not in self.stored:
                break
            hit += 1
        return hit

    def _reachable_store_block_mask(self, group_config, start, end, final, boundaries):
        if group_config.group_idx == 0:
            return None  # full attention: dense
        keep = {b // TPC - 1 for b in boundaries}
        return [i in keep for i in range(start, end)]


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
