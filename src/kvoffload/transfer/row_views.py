"""Views of many block rows at once, made in C loops: the ``runs`` copy strategy's inputs.

A copy of scattered rows is one ``_foreach_copy_`` over (destination view,
source view) pairs; what costs is making the views. A Python slice per row
costs 1-7 us (a fused multi-plane slice is the dearer), more than copying a
16 KiB block. Here:

- a run of one row (the common case when ids are scattered) is a cached view
  of that row, picked with ``operator.itemgetter`` (a C loop over a list);
  rows are viewed lazily, a chunk of ``CHUNK_ROWS`` at a time by one
  ``unbind``, so only the parts of a tier a job touched hold views (a view is
  ~0.4 KB; a row at least a few KiB);
- longer runs are cut out by one ``split_with_sizes`` per side (sorted by
  start, then put back in run order by ``itemgetter``).

Views are made with inference mode off: a view made under an engine's
``inference_mode`` may not be written through outside it (pool threads).
"""

from __future__ import annotations

import operator
import threading
from typing import cast

import numpy as np
import torch

#: Rows viewed together the first time a job touches any of them.
CHUNK_ROWS = 1024


def _pick(
    items: list[torch.Tensor] | tuple[torch.Tensor, ...], idx: np.ndarray
) -> list[torch.Tensor]:
    """``[items[i] for i in idx]`` without a Python loop."""
    if idx.size == 0:
        return []
    if idx.size == 1:
        return [items[int(idx[0])]]
    return list(operator.itemgetter(*idx.tolist())(items))


class RowViews:
    """Lazily cached per-row views of one group (``[planes, blocks, row]``, dim 1 the block).

    A single-plane group is viewed as ``[blocks, row]`` (its slices stay
    contiguous, so a device copy is one memcpy). Thread-safe: two threads
    viewing the same chunk make equal views, either one is kept.
    """

    def __init__(self, group: torch.Tensor) -> None:
        self.flat = group.shape[0] == 1
        self.tensor = group[0] if self.flat else group
        self.dim = 0 if self.flat else 1
        self.num_rows = int(group.shape[1])
        self._rows: list[torch.Tensor | None] = [None] * self.num_rows
        self._viewed = np.zeros((self.num_rows + CHUNK_ROWS - 1) // CHUNK_ROWS, dtype=bool)
        self._lock = threading.Lock()

    def rows(self, idx: np.ndarray) -> list[torch.Tensor]:
        """Views of rows ``idx`` (any order, repeats allowed), one row each."""
        chunks = np.unique(idx // CHUNK_ROWS)
        missing = chunks[~self._viewed[chunks]]
        if missing.size:
            self._view_chunks(missing)
        return _pick(cast("list[torch.Tensor]", self._rows), idx)  # filled above

    def _view_chunks(self, chunks: np.ndarray) -> None:
        with self._lock, torch.inference_mode(False):
            for c in chunks.tolist():  # once per chunk of CHUNK_ROWS rows, ever
                if self._viewed[c]:
                    continue
                a = c * CHUNK_ROWS
                b = min(a + CHUNK_ROWS, self.num_rows)
                self._rows[a:b] = self.tensor.narrow(self.dim, a, b - a).unbind(self.dim)
                self._viewed[c] = True

    def runs(self, starts: np.ndarray, lengths: np.ndarray) -> list[torch.Tensor]:
        """Views of rows ``[starts[i], starts[i] + lengths[i])``, in the given order."""
        if starts.size == 0:
            return []
        order = np.argsort(starts, kind="stable")
        first = starts[order]
        ends = first + lengths[order]
        gaps = first - np.concatenate(([0], ends[:-1]))
        if (gaps < 0).any():  # a source row copied to several places: slice run by run
            with torch.inference_mode(False):
                return [
                    self.tensor.narrow(self.dim, a, k)
                    for a, k in zip(starts.tolist(), lengths.tolist())
                ]
        sizes = np.empty(2 * first.size + 1, dtype=np.int64)
        sizes[0:-1:2] = gaps
        sizes[1::2] = lengths[order]
        sizes[-1] = self.num_rows - ends[-1]
        with torch.inference_mode(False):
            pieces = self.tensor.split_with_sizes(sizes.tolist(), self.dim)[1::2]
        back = np.empty_like(order)
        back[order] = np.arange(order.size)
        return _pick(pieces, back)


def run_views(
    src: RowViews,
    dst: RowViews,
    src_starts: np.ndarray,
    dst_starts: np.ndarray,
    lengths: np.ndarray,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destination views, source views) for runs of ``lengths`` rows, paired in order."""
    single = lengths == 1
    dsts = dst.rows(dst_starts[single])
    srcs = src.rows(src_starts[single])
    if single.all():
        return dsts, srcs
    multi = ~single
    dsts += dst.runs(dst_starts[multi], lengths[multi])
    srcs += src.runs(src_starts[multi], lengths[multi])
    return dsts, srcs
