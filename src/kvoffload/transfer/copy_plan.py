"""Batched row copies between block planes: ``dst[dst_rows[i]] = src[src_rows[i]]``.

A row is one block's bytes in one plane (``KVLayout.block_planes``); copies
work on *groups*, ``[planes, blocks, row]`` integer views that are a single
view over every plane when the tensors come from one region (see
``KVLayout.block_groups``), so one op moves a block in all layers. Both sides
have the same layout kind, so group ``g`` of the source pairs with group
``g`` of the destination.

The difficulty is that torch has no single-pass "gather from here, scatter to
there" op: ``dst.index_copy_(0, d, src.index_select(0, s))`` reads and writes
every byte twice. Single-pass alternatives exist whenever one side is
consecutive, so the rows are grouped first:

``runs``
    maximal runs where source *and* destination rows both advance by one;
    each run is one slice copy, all issued in one ``torch._foreach_copy_`` call
    (its loop is in C++). Best when runs are long or rows are big.
``dst_runs``
    runs of consecutive destination rows; each is one ``index_select`` from
    the source straight into the destination slice (``out=``). On one device
    a fused multi-plane slice is strided, and ``index_select`` into it copies
    element by element; with few runs (a job's CPU slots handed out
    consecutively) each plane is gathered on its own instead, where
    ``index_select`` moves whole rows by ``memcpy`` (``GroupPairs.plane_split``).
``src_runs``
    runs of consecutive source rows; each is one scatter of a source slice
    into the destination: in host memory numpy's indexed assignment (a C loop
    copying whole rows), elsewhere ``index_copy_`` (element by element).
``staged``
    gather into a temporary, then scatter: two passes, one pair of calls per
    group, for many tiny scattered rows where per-call overhead dominates.

``choose_strategy`` ranks them by a crude cost model. On a 2-core host, 1,000
random blocks of 256 KiB move at about 80-87% of one bulk copy's bandwidth
with ``dst_runs`` (``kvoffload bench transfer``).

Across devices (GPU <-> host) the index ops run on the device side only and
every host-side access is a slice, so host memory is only touched by DMA
copies: a store may use ``runs`` or ``dst_runs``, a load ``runs`` or
``src_runs``; ``staged`` is same-device only.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.row_views import RowViews, run_views

STRATEGIES: tuple[str, ...] = ("runs", "dst_runs", "src_runs", "staged")

#: Part of every block row of one plane: (plane, first byte, end byte).
Span = tuple[int, int, int]

# Rough per-call costs in seconds, used only to rank strategies against each
# other; one extra pass over the bytes is costed at _PASS_SECONDS_PER_BYTE.
_RUN_COPY_CALL = 2.5e-6
_INDEX_CALL = 7e-6
_PASS_SECONDS_PER_BYTE = 1 / 10e9
# index_copy_ runs element by element, slower than the memcpy rows of
# index_select: costed as this fraction of an extra pass (not into host memory,
# where ``_scatter`` copies rows with numpy).
_SCATTER_PENALTY = 0.3
# On one device a multi-plane group is strided, so index_select into it takes
# torch's element-wise path rather than a memcpy per row: costed as this
# fraction of an extra pass (1,000 random 256 KiB blocks: runs 0.90 of a
# one-thread bulk copy, dst_runs 0.80; 16 KiB: 0.35 against 0.41).
_STRIDED_GATHER_PENALTY = 0.2


def _runs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Start positions of maximal runs where ``a`` and ``b`` both step by +1."""
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = (np.diff(a) != 1) | (np.diff(b) != 1)
    return np.concatenate(([0], np.flatnonzero(breaks) + 1))


def _single_runs(a: np.ndarray) -> np.ndarray:
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(([0], np.flatnonzero(np.diff(a) != 1) + 1))


@dataclass(frozen=True)
class RowPairs:
    """Row pairs ordered by destination row, with run boundaries.

    ``dst_rows`` must be distinct (a destination written twice would depend
    on copy order); ``src_rows`` may repeat. ``run_starts`` is computed at
    build; the single-side runs only when a strategy asks for them (a job
    whose rows are consecutive on both sides never needs them, and planning
    sits on the path of every synchronous load).
    """

    src_rows: np.ndarray  # sorted by dst
    dst_rows: np.ndarray  # ascending
    run_starts: np.ndarray  # into the dst-sorted arrays: both sides consecutive

    @classmethod
    def build(cls, src_rows: np.ndarray, dst_rows: np.ndarray) -> RowPairs:
        src = np.asarray(src_rows, dtype=np.int64)
        dst = np.asarray(dst_rows, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"row pairs need equal 1-D shapes, got {src.shape} and {dst.shape}")
        steps = np.diff(dst)
        if not (steps > 0).all():  # already ascending (the usual case): no sort
            order = np.argsort(dst, kind="stable")
            src, dst = src[order], dst[order]
            steps = np.diff(dst)
            if dst.size > 1 and not (steps > 0).all():
                dup = int(dst[np.flatnonzero(steps == 0)[0]])
                raise ValueError(f"destination block {dup} appears more than once")
        return cls(src_rows=src, dst_rows=dst, run_starts=_runs(src, dst))

    @functools.cached_property
    def dst_run_starts(self) -> np.ndarray:
        """Into the dst-sorted arrays: starts of runs of consecutive destination rows."""
        return _single_runs(self.dst_rows)

    @functools.cached_property
    def by_src(self) -> np.ndarray:
        """The permutation putting the pairs in source order."""
        return np.argsort(self.src_rows, kind="stable")

    @functools.cached_property
    def src_run_starts(self) -> np.ndarray:
        """Into the src-sorted arrays: starts of runs of consecutive source rows."""
        return _single_runs(self.src_rows[self.by_src])

    @property
    def num_rows(self) -> int:
        return int(self.dst_rows.size)

    def slice(self, start: int, stop: int, by_src: bool = False) -> RowPairs:
        """The pairs ``start:stop`` in destination order (``by_src``: in source order),
        as their own ``RowPairs``."""
        if by_src:
            order = self.by_src[start:stop]
            return RowPairs.build(self.src_rows[order], self.dst_rows[order])
        return RowPairs.build(self.src_rows[start:stop], self.dst_rows[start:stop])


class GroupPairs:
    """Matching ``[planes, blocks, row]`` groups of a source and a destination tensor set.

    Built once per tensor pair (views are cheap but not free). Two widths are
    kept because torch's kernels differ: ``copy_`` and ``index_select`` move
    whole rows with memcpy and split work across threads by element count,
    so byte elements (``narrow``) parallelise even moderate rows, while
    ``index_copy_`` runs element by element and wants the widest integer
    (``wide``). Both sides are fused into one group only when both can be.
    """

    def __init__(
        self,
        layout: KVLayout,
        src: Sequence[torch.Tensor],
        dst: Sequence[torch.Tensor],
        fuse: bool = True,
    ) -> None:
        width = math.gcd(layout.view_width(src), layout.view_width(dst))
        # Across devices every copy must be a contiguous slice on both sides to
        # be one asynchronous memcpy; a fused multi-plane slice is strided, and
        # torch would stage it through pageable memory synchronously.
        # ``fuse=False`` keeps group i == plane i (for copying some planes only).
        fuse = fuse and src[0].device == dst[0].device
        self.narrow = self._pairs(layout, src, dst, 1, fuse)
        self.wide = self._pairs(layout, src, dst, width, fuse)
        self.src_device = self.narrow[0][0].device
        self.dst_device = self.narrow[0][1].device
        self.row_bytes = layout.plane_row_bytes
        self.bytes_per_block = layout.bytes_per_block
        self._views: list[tuple[RowViews, RowViews]] | None = None
        self._team_views: list[tuple[RowViews, RowViews]] | None = None

    def row_views(self, team: bool = False) -> list[tuple[RowViews, RowViews]]:
        """Cached row views (source, destination), for ``runs``.

        By default of the ``wide`` groups: wide integer elements keep each
        row's copy under torch's parallel grain (32768 elements), so a copy
        never opens an OpenMP team: a job's parallelism is its shards, one per
        thread, whoever runs them. ``team``: of the ``narrow`` (byte) groups,
        for a job run whole by a thread whose team is its own (an expedited
        load on the engine's thread): a row of 32 KiB or more is then split
        across the team (12 MB of random 128 KiB blocks on 2 cores: 6.5-7.3
        GB/s wide, 9.0-10.3 narrow, a cold bulk copy 10.9-12.8).
        """
        if team:
            if self._team_views is None:
                self._team_views = [(RowViews(sg), RowViews(dg)) for sg, dg in self.narrow]
            return self._team_views
        if self._views is None:
            self._views = [(RowViews(sg), RowViews(dg)) for sg, dg in self.wide]
        return self._views

    @staticmethod
    def _pairs(
        layout: KVLayout,
        src: Sequence[torch.Tensor],
        dst: Sequence[torch.Tensor],
        width: int,
        fuse: bool,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sg = layout.block_groups(src, width, fuse)
        dg = layout.block_groups(dst, width, fuse)
        if len(sg) != len(dg):
            sg = layout.block_groups(src, width, fuse=False)
            dg = layout.block_groups(dst, width, fuse=False)
        return list(zip(sg, dg))

    def spans(self, spans: Sequence[Span]) -> GroupPairs:
        """The same pairs restricted to byte ranges of rows: ``(plane, start, stop)`` each,
        on unfused groups (group i is plane i). Rows narrowed so are strided: copy them
        with the ``runs`` strategy, whose slice copies take any strides."""
        out = copy.copy(self)
        out.narrow = [
            (s[:, :, a:b], d[:, :, a:b]) for p, a, b in spans for s, d in [self.narrow[p]]
        ]
        out.wide = out.narrow
        out.bytes_per_block = sum(b - a for _, a, b in spans)
        out._views = out._team_views = None
        out.__dict__.pop("plane_split", None)
        return out

    def whole_planes(self, spans: Sequence[Span]) -> GroupPairs | None:
        """The pairs restricted to planes ``p0..p1``, as one fused group, when ``spans`` are
        the whole rows of those consecutive planes and the pairs are fused; else None.

        A staged load's stage is typically one layer's K and V planes: one copy per
        block moves both, in wide elements, where ``spans`` makes a copy per plane.
        """
        if len(self.narrow) != 1 or not spans:
            return None
        planes = sorted(p for p, _, _ in spans)
        if any(a != 0 or b != self.row_bytes for _, a, b in spans) or planes != list(
            range(planes[0], planes[0] + len(planes))
        ):
            return None
        p0, p1 = planes[0], planes[-1] + 1
        out = copy.copy(self)
        out.narrow = [(s[p0:p1], d[p0:p1]) for s, d in self.narrow]
        out.wide = [(s[p0:p1], d[p0:p1]) for s, d in self.wide]
        out.bytes_per_block = (p1 - p0) * self.row_bytes
        out._views = out._team_views = None
        out.__dict__.pop("plane_split", None)
        return out

    @functools.cached_property
    def plane_split(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The ``narrow`` groups cut into one single-plane group per plane, when they are
        multi-plane, on one device, and each plane's rows lie back to back (so that a
        plane's run of rows is one contiguous slice); else None."""
        if self.src_device != self.dst_device or all(s.shape[0] == 1 for s, _ in self.narrow):
            return None
        out = []
        for sg, dg in self.narrow:
            for p in range(sg.shape[0]):
                s, d = sg[p], dg[p]
                if not (s.is_contiguous() and d.is_contiguous()):
                    return None
                out.append((sg[p : p + 1], dg[p : p + 1]))
        return out

    @property
    def cross_device(self) -> str | None:
        """None on one device; "store" when the destination is host memory, else "load"."""
        if self.src_device == self.dst_device:
            return None
        return "store" if self.dst_device.type == "cpu" else "load"


_ALLOWED: dict[str | None, tuple[str, ...]] = {
    None: STRATEGIES,
    "store": ("runs", "dst_runs"),
    "load": ("runs", "src_runs"),
}


def choose_strategy(pairs: RowPairs, groups: GroupPairs) -> str:
    """The cheapest allowed strategy by a crude model: calls x call cost + extra passes."""
    if len(pairs.run_starts) <= 1:
        return "runs"  # one slice copy per group: nothing is cheaper
    num_groups = len(groups.narrow)
    nbytes = pairs.num_rows * groups.bytes_per_block
    # Into host memory a scatter is numpy's row copy (``_scatter``), not element-wise.
    scatter = 0.0 if groups.dst_device.type == "cpu" else _SCATTER_PENALTY
    costs = {
        "runs": len(pairs.run_starts) * num_groups * _RUN_COPY_CALL,
        "dst_runs": _dst_runs_cost(pairs, groups)[0],
        "src_runs": len(pairs.src_run_starts) * num_groups * _INDEX_CALL
        + nbytes * scatter * _PASS_SECONDS_PER_BYTE,
        "staged": num_groups * 2 * _INDEX_CALL + nbytes * (1 + scatter) * _PASS_SECONDS_PER_BYTE,
    }
    return min(_ALLOWED[groups.cross_device], key=lambda s: costs[s])


def _dst_runs_cost(
    pairs: RowPairs, groups: GroupPairs
) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The cost of ``dst_runs`` and the groups it copies: the fused ones, or one per
    plane where that is cheaper (a call per plane per run against an element-wise
    gather into strided slices)."""
    runs = len(pairs.dst_run_starts)
    fused = groups.narrow
    strided = _STRIDED_GATHER_PENALTY if fused[0][0].shape[0] > 1 else 0.0
    nbytes = pairs.num_rows * groups.bytes_per_block
    cost = runs * len(fused) * _INDEX_CALL + nbytes * strided * _PASS_SECONDS_PER_BYTE
    split = groups.plane_split if strided else None
    if split is not None and runs * len(split) * _INDEX_CALL < cost:
        return runs * len(split) * _INDEX_CALL, split
    return cost, fused


def _segments(starts: np.ndarray, n: int) -> list[tuple[int, int]]:
    ends = np.append(starts[1:], n)
    return list(zip(starts.tolist(), ends.tolist()))


def _rows(g: torch.Tensor, start: int, count: int) -> torch.Tensor:
    # A single-plane group is used as a plain 2-D [blocks, row] tensor so that
    # slices stay contiguous and index ops take their dim-0 memcpy paths.
    return g[0, start : start + count] if g.shape[0] == 1 else g[:, start : start + count]


def _select(g: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if g.shape[0] == 1:
        return torch.index_select(g[0], 0, idx, out=out) if out is not None else g[0][idx]
    return torch.index_select(g, 1, idx, out=out) if out is not None else g.index_select(1, idx)


def _scatter(g: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    if g.device.type == "cpu" and values.device.type == "cpu":
        # index_copy_ moves element by element; numpy's indexed assignment copies each
        # row in one C loop, at a slice copy's rate (12 MB of 32 KiB rows, one thread:
        # 7.0 against 9.9 GB/s, a slice 10.9; see docs/transfer.md), GIL released.
        with torch.inference_mode(False):
            if g.shape[0] == 1:
                g[0].numpy()[idx.numpy()] = values.numpy()
            else:
                g.numpy()[:, idx.numpy()] = values.numpy()
        return
    if g.shape[0] == 1:
        g[0].index_copy_(0, idx, values)
    else:
        g.index_copy_(1, idx, values)


def copy_rows(
    groups: GroupPairs,
    pairs: RowPairs,
    strategy: str | None = None,
    non_blocking: bool = False,
    team: bool = False,
) -> str:
    """Copy ``pairs`` across every (source, destination) group; returns the strategy used.

    Rows must be in range (the caller validates ids, this function trusts
    them). With ``non_blocking`` cross-device copies are only enqueued on the
    current stream; the caller records an event after. ``team``: the calling
    thread's torch threads are this job's alone (``GroupPairs.row_views``).
    """
    n = pairs.num_rows
    if n == 0:
        return "runs"
    cross = groups.cross_device
    if strategy is None:
        strategy = choose_strategy(pairs, groups)
    elif strategy not in STRATEGIES:
        raise ValueError(f"unknown copy strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if strategy not in _ALLOWED[cross]:
        raise ValueError(f"strategy {strategy!r} cannot be used for a cross-device {cross}")

    s, d = pairs.src_rows, pairs.dst_rows
    if strategy == "runs":
        starts = pairs.run_starts
        lengths = np.diff(np.append(starts, n))
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        for sv, dv in groups.row_views(team):
            dl, sl = run_views(sv, dv, s[starts], d[starts], lengths)
            dsts += dl
            srcs += sl
        _foreach_copy(dsts, srcs, non_blocking)
    elif strategy == "dst_runs":
        idx = _index_on(groups.src_device, s)
        pieces = _dst_runs_cost(pairs, groups)[1] if cross is None else groups.narrow
        for a, b in _segments(pairs.dst_run_starts, n):
            d0, k = int(d[a]), b - a
            for sg, dg in pieces:
                if cross is None:
                    _select(sg, idx[a:b], out=_rows(dg, d0, k))
                else:
                    _rows(dg, d0, k).copy_(_select(sg, idx[a:b]), non_blocking=non_blocking)
    elif strategy == "src_runs":
        s_sorted = s[pairs.by_src]
        idx = _index_on(groups.dst_device, d[pairs.by_src])
        for a, b in _segments(pairs.src_run_starts, n):
            s0, k = int(s_sorted[a]), b - a
            for sg, dg in groups.wide:
                chunk = _rows(sg, s0, k)
                if cross is not None:
                    chunk = chunk.to(groups.dst_device, non_blocking=non_blocking)
                _scatter(dg, idx[a:b], chunk)
    else:  # staged
        sidx = torch.from_numpy(s)
        didx = torch.from_numpy(d)
        for sg, dg in groups.wide:
            _scatter(dg, didx, _select(sg, sidx))
    return strategy


def _index_on(device: torch.device, rows: np.ndarray) -> torch.Tensor:
    """``rows`` as an index tensor on ``device`` without blocking the caller.

    A pageable upload would synchronise the current (transfer) stream and so
    wait for the compute it was told to wait for; a pinned one is queued. The
    pinned buffer is kept alive by torch's host allocator until the copy ran.
    """
    t = torch.from_numpy(np.ascontiguousarray(rows))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs, non_blocking=non_blocking)
        return
    for dt, st in zip(dsts, srcs):  # torch builds without the fused list op
        dt.copy_(st, non_blocking=non_blocking)
