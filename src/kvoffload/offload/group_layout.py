"""What a tier must know of each KV cache group to keep the keys a hit can use.

A hybrid model's tier holds one key per chunk per group; a group's *kind*
and window decide how many chunks before a hit boundary a hit needs of it
(:attr:`GroupLayout.reach_chunks`). ``kvoffload.offload.chunk_units`` keeps
a tier's keys by this layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"
MAMBA = "mamba"
GROUP_KINDS = (FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """What the tier must know of one KV cache group to keep its useful keys.

    ``kind``: one of ``GROUP_KINDS`` (MLA, EAGLE / MTP drafter groups and other
    groups that need every chunk of a prefix are ``full_attention``);
    ``sliding_window``: the window in tokens (sliding window) or the attention
    chunk in tokens (chunked local attention), None otherwise;
    ``tokens_per_chunk``: tokens per offloaded chunk (one key) of this group;
    ``slot_bytes``: bytes one key of this group occupies in the tier (reported,
    not used for decisions).
    """

    kind: str = FULL_ATTENTION
    sliding_window: int | None = None
    tokens_per_chunk: int = 16
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"unknown KV cache group kind {self.kind!r}; known: {GROUP_KINDS}")
        if self.tokens_per_chunk < 1:
            raise ValueError(f"tokens_per_chunk must be positive, got {self.tokens_per_chunk}")
        windowed = self.kind in (SLIDING_WINDOW, CHUNKED_LOCAL)
        if windowed and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"a {self.kind} group needs a positive sliding_window")

    @property
    def reach_chunks(self) -> int | None:
        """How many chunks before a hit boundary a hit needs of this group; None: all.

        Hits end on chunk boundaries (an engine recomputes at most the last
        prompt token, inside the last hit chunk), so a sliding window of W
        tokens needs ``ceil(W / T)`` chunks before the boundary, chunked local
        attention at most one attention chunk, ``ceil(C / T)`` (vLLM 0.33's
        ``sliding_window_size_in_chunks`` and its load window for those hits),
        and a Mamba group only the state at the boundary.
        """
        if self.kind == MAMBA:
            return 1
        if self.sliding_window is None:
            return None
        return -(-self.sliding_window // self.tokens_per_chunk)


def uses_chunk_units(layout: Sequence[GroupLayout] | None) -> bool:
    """Whether a tier with ``layout`` needs the unit layer (two groups or more)."""
    return layout is not None and len(layout) > 1
