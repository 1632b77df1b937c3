"""Chain links between a tier's chunks and the known hit boundaries.

A *unit* is a chunk's block hash (an ``OffloadKey`` without its 4-byte group
suffix). Hits end on chunk boundaries; a windowed group's key is worth
keeping only when a known boundary follows its chunk within the group's
reach (``GroupLayout.reach_chunks``). This module learns where chains go on
and where hits can end; ``kvoffload.offload.chunk_units`` decides what that
means for each stored key.

Invariants: ``prev`` and ``boundary`` are never rebound (``clear`` empties
them in place), so a holder may alias them; links come only from groups
whose keys cover every chunk (full attention), or from every group when
there is none.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.group_layout import GroupLayout

#: Bytes of the group index at the end of an OffloadKey.
SUFFIX_BYTES = 4
_SUFFIX = SUFFIX_BYTES


class ChunkChains:
    """Per windowed group its reach; per unit the unit before it and whether a boundary follows."""

    def __init__(self, layout: Sequence[GroupLayout]) -> None:
        # Windowed groups by key suffix: how many chunks before a boundary they must keep.
        self.reach: dict[bytes, int] = {}
        full: list[bytes] = []
        for idx, group in enumerate(layout):
            suffix = idx.to_bytes(_SUFFIX, "big")
            reach = group.reach_chunks
            if reach is None:
                full.append(suffix)
            else:
                self.reach[suffix] = reach
        # Chain links come from the groups whose keys cover every chunk.
        self.link_suffixes = frozenset(full) if full else None
        self.max_reach = max(self.reach.values(), default=0)
        self.prev: dict[bytes, bytes] = {}  # unit -> the unit before it in its chain
        self.boundary: set[bytes] = set()  # units a hit boundary follows

    def clear(self) -> None:
        self.prev.clear()
        self.boundary.clear()

    def forget(self, unit: bytes) -> None:
        """``unit`` left the tier: its link and boundary go."""
        self.prev.pop(unit, None)
        self.boundary.discard(unit)

    def link(self, child_unit: bytes, unit: bytes, suffix: bytes) -> None:
        """``child_unit`` follows ``unit`` in a chain of the group ``suffix`` names."""
        link = self.link_suffixes
        if link is None or suffix in link:
            self.prev[child_unit] = unit

    def classify(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Per key: held (True) or dead. Also learns chain links and run-end boundaries.

        Keys of one call come as runs of one group's keys in chain order (a
        request's chunks; vLLM's stores list group after group). A run's end
        is a boundary (a prompt ends there); a windowed key is live when a
        boundary follows its chunk within its group's reach.
        """
        n = len(keys)
        live = [True] * n
        if not self.reach and self.link_suffixes is None:
            return live
        link, reach, prev, boundary = self.link_suffixes, self.reach, self.prev, self.boundary
        i = 0
        while i < n:
            suffix = keys[i][-_SUFFIX:]
            j = i + 1
            while j < n and keys[j][-_SUFFIX:] == suffix:
                j += 1
            if link is None or suffix in link:
                for a, b in zip(keys[i : j - 1], keys[i + 1 : j]):
                    ua, ub = a[:-_SUFFIX], b[:-_SUFFIX]
                    if ua != ub:
                        prev[ub] = ua
            r = reach.get(suffix)
            if r is not None:
                # A prompt ends here: a later turn hits at its end, the same prompt again one
                # chunk earlier when its length is a whole number of chunks (the last token is
                # recomputed). Both are boundaries.
                boundary.add(keys[j - 1][:-_SUFFIX])
                if j - 2 >= i:
                    boundary.add(keys[j - 2][:-_SUFFIX])
                since = 0
                for k in range(j - 1, i - 1, -1):
                    if keys[k][:-_SUFFIX] in boundary:
                        since = 0
                    live[k] = since < r
                    since += 1
            i = j
        return live

    def queued_boundary(
        self, keys: Sequence[OffloadKey], stored: Collection[OffloadKey]
    ) -> bytes | None:
        """Where a queued request's hit will end (the last stored key of its chain's
        linking groups), now a boundary; None when none of its chain is stored."""
        link = self.link_suffixes
        last: OffloadKey | None = None
        for key in keys:
            if link is not None and key[-_SUFFIX:] not in link:
                continue
            if key not in stored:
                break
            last = key
        if last is None:
            return None
        unit = last[:-_SUFFIX]
        self.boundary.add(unit)
        return unit
