"""A stand-in for what ``window_keep`` reads of vLLM's ``OffloadingConnectorScheduler``
(no vLLM needed): ``config.alignment_tokens`` / ``blocks_per_chunk`` / ``kv_group_configs``,
``manager``, ``_full_attention_groups``, ``_sliding_window_groups``,
``_maximal_prefix_lookup`` and ``_reachable_store_block_mask``.

One full-attention group (0) and one sliding-window group (1) of ``window`` tokens, one
block per chunk of ``TPC`` tokens. The mask keeps, as vLLM's sliding-window manager does,
the chunks a hit at each reachable boundary needs (the ``ceil(window / TPC)`` before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

TPC = 32  # tokens per chunk (one block per chunk)


@dataclass
class Group:
    group_idx: int
    kv_cache_spec: Any
    tokens_per_chunk: int = TPC


def window_mask(start: int, end: int, boundaries: tuple[int, ...], window: int) -> list[bool]:
    """vLLM's sliding-window mask at one block per chunk: the chunks before each boundary."""
    need = -(-window // TPC)
    keep = {c for b in boundaries for c in range(b // TPC - need, b // TPC)}
    return [i in keep for i in range(start, end)]


@dataclass
class Stand:
    """The scheduler: ``stored`` are the keys a lookup finds (in order, up to the first miss)."""

    manager: Any = None
    stored: set[bytes] = field(default_factory=set)
    window: int = TPC
    _full_attention_groups: tuple[int, ...] = (0,)
    _sliding_window_groups: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        self.config = SimpleNamespace(
            alignment_tokens=TPC,
            blocks_per_chunk=1,
            kv_group_configs=[
                Group(0, SimpleNamespace()),
                Group(1, SimpleNamespace(sliding_window=self.window)),
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
        return window_mask(start, end, boundaries, self.window)
