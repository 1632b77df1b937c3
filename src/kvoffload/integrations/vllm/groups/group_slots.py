"""CPU slots per KV cache group: which groups share a slot space, how big a slot is, how many.

vLLM builds one KV cache group per kind of layer (full attention, sliding
window, Mamba, MLA, drafter layers); each offloaded chunk has one key per
group. vLLM's own CPU tier gives every key a slot of the whole GPU block
(every group's layers, padded to the widest group). Here groups are sized
by what their blocks hold:

- A *slot class* is a set of groups whose blocks hold the same bytes; its
  keys share one slot-id space (one manager, one host pool), so a chunk's
  keys of the class's groups compete for the same room, as in vLLM. A
  group with fewer layers than the others (vLLM's remainder group, e.g.
  Gemma 3's last sliding-window group) is a class of its own with smaller
  slots.
- ``cpu_bytes`` is split over the classes in proportion to the bytes one
  chunk of all the class's groups takes, so every group can hold the same
  number of chunks. With one class this is exactly one slot per
  ``cpu_bytes // slot_bytes``, as before.

Both sides (the scheduler's manager, each worker's host pools) compute the
plan from the same ``OffloadingConfig`` with ``plan_group_slots``, so slot
ids agree without any message between them. Where the layout is not known
to be layer-outermost (vLLM's block-outermost "packed" layouts, where every
group's pages sit inside one block row, or a layout vLLM does not name), and
under vLLM's shared region (lower tiers: vLLM's tiering manager and its
secondary tiers read rows of one size), there is one class whose slots hold
the whole GPU block, exactly vLLM's sizing.

Layer-outermost layouts give every layer of a group a page of the same size
(vLLM requires uniform pages there), and groups alias one block-id space: a
group of ``n`` layers occupies ``n`` pages of a block. The page is
``worker_kv_bytes_per_block`` (the widest group's block) over the widest
group's layer count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.settings import KVOffloadConfigError
from kvoffload.transfer import format_bytes


@dataclass(frozen=True)
class SlotClass:
    """Groups (positions in ``OffloadingConfig.groups``) sharing one slot-id space.

    ``bytes_per_block``: one worker's bytes of one GPU block of any of them;
    ``pages``: how many equal pages that is (0: the whole block row, the
    single-class layout); ``num_slots``: the class's CPU slots.
    """

    groups: tuple[int, ...]
    bytes_per_block: int
    pages: int
    num_slots: int


@dataclass(frozen=True)
class GroupSlotPlan:
    """The slot classes of one engine. Invariant: every group is in exactly one class."""

    classes: tuple[SlotClass, ...]
    class_of: tuple[int, ...]
    blocks_per_chunk: int
    world_size: int

    @property
    def single(self) -> bool:
        return len(self.classes) == 1

    def slot_bytes(self, class_idx: int) -> int:
        """One worker's bytes of one slot (one offloaded chunk of one group) of a class."""
        return self.classes[class_idx].bytes_per_block * self.blocks_per_chunk

    def group_slot_bytes(self, group: int) -> int:
        return self.slot_bytes(self.class_of[group])

    def describe(self, group_names: Sequence[str]) -> str:
        """One line: bytes per slot per group (all workers) and each class's slots."""
        parts = []
        for c, cls in enumerate(self.classes):
            names = ", ".join(group_names[g] for g in cls.groups)
            per_slot = format_bytes(self.slot_bytes(c) * self.world_size)
            parts.append(f"[{names}]: {cls.num_slots} slots of {per_slot}")
        return "; ".join(parts)


def block_outermost(layout_name: str | None) -> bool | None:
    """Whether vLLM's KV cache layout of this name packs all layers inside each block;
    None when the name is unknown (or vLLM has no such enum)."""
    if not layout_name:
        return None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return bool(KVCacheLayout[layout_name].is_block_outermost)
    except (ImportError, KeyError, AttributeError):
        return None


def group_block_bytes(config: Any) -> list[int] | None:
    """One worker's bytes of one GPU block of each group, or None where the layout
    does not tell them apart (block-outermost or unnamed layouts, one group, or
    groups of equal layer counts: then every group's block is the whole block)."""
    per_block = int(config.worker_kv_bytes_per_block)
    layers = [max(1, len(g.layer_names)) for g in config.groups]
    widest = max(layers, default=1)
    layer_outer = block_outermost(getattr(config, "kv_cache_layout", None)) is False
    if len(set(layers)) < 2 or not layer_outer or per_block <= 0 or per_block % widest:
        return None
    return [n * (per_block // widest) for n in layers]


def group_layout_fingerprint(config: Any) -> str:
    """The KV cache groups as tiers must tell them apart: per group, its kind as far as
    vLLM's offloading config says ("full", or "window<chunks>" for sliding-window,
    chunked-local and Mamba groups; "any" where vLLM 0.32 does not say), tokens per
    block, layer count, bytes per block on all workers, and a digest of its layer names."""
    per_group = group_block_bytes(config)
    world = max(1, int(config.parallel.world_size))
    parts = []
    for pos, g in enumerate(config.groups):
        known, chunks = compat.group_window_chunks(g)
        kind = "any" if not known else ("full" if chunks is None else f"window{chunks}")
        nbytes = per_group[pos] if per_group is not None else int(config.worker_kv_bytes_per_block)
        # All ranks' bytes: a layout vLLM certifies as parallelism-agnostic reads the
        # same tier under any TP size, and its per-rank share differs between them.
        nbytes *= world
        names = hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:8]
        parts.append(f"{kind}/{g.tokens_per_block}x{len(g.layer_names)}/{nbytes}B/{names}")
    return ",".join(parts)


def plan_group_slots(
    config: Any,
    cpu_bytes: int,
    blocks_per_chunk: int,
    shared_rows: bool = False,
    windowed: Sequence[bool] | None = None,
) -> GroupSlotPlan:
    """The slot classes for vLLM's ``OffloadingConfig`` and a CPU budget of ``cpu_bytes``.

    ``windowed[pos]``: whether the group at ``pos`` keeps only a window of a
    prefix (sliding window, chunked local, Mamba); None when not known, and
    then there is one class. Groups that need every chunk of a prefix (full
    attention, MLA, drafters) get one class per layer count, and the budget
    is split so each of them can hold the same number of chunks. Windowed
    groups hold a few chunks per prefix, so they share the slots of the
    widest such class (their slots padded to it, as in vLLM): a class of
    their own would have to guess their share of the budget, and an equal
    share left the full-attention groups short (on a 4 + 10 layer hybrid at
    2-4 MiB, 33% fewer cached tokens than vLLM's single slot space).
    ``shared_rows``: the CPU tier lives in vLLM's shared region (one row size,
    one class; the caller sizes the rows). ``KVOffloadConfigError`` when the
    budget cannot hold one slot of some class.
    """
    world = max(1, int(config.parallel.world_size))
    per_block = int(config.worker_kv_bytes_per_block)
    layers = [max(1, len(g.layer_names)) for g in config.groups]
    per_group = None if shared_rows or windowed is None else group_block_bytes(config)
    full = [g for g in range(len(layers)) if windowed is not None and not windowed[g]]
    widest_full = max((layers[g] for g in full), default=0)
    if (
        per_group is None
        or len({layers[g] for g in full}) < 2
        or max(layers) > widest_full  # a windowed group wider than every full one
    ):
        groups = tuple(range(len(layers)))
        n = _slots(cpu_bytes, per_block * blocks_per_chunk * world, "a GPU block", world)
        cls = SlotClass(groups, per_block, 0, n if per_block > 0 else 0)
        return GroupSlotPlan((cls,), (0,) * len(layers), blocks_per_chunk, world)
    page = per_block // max(layers)
    by_pages: dict[int, list[int]] = {}
    for g in full:
        by_pages.setdefault(layers[g], []).append(g)
    by_pages[widest_full].extend(g for g in range(len(layers)) if g not in full)
    total = sum(layers[g] * page for g in full)
    classes = []
    class_of = [0] * len(layers)
    for c, (pages, members) in enumerate(sorted(by_pages.items(), reverse=True)):
        n_full = sum(1 for g in members if g in full)
        share = cpu_bytes * n_full * pages * page // total
        slot = pages * page * blocks_per_chunk * world
        n = _slots(share, slot, f"a block of {pages} layer page(s)", world, cpu_bytes)
        classes.append(SlotClass(tuple(sorted(members)), pages * page, pages, n))
        for g in members:
            class_of[g] = c
    return GroupSlotPlan(tuple(classes), tuple(class_of), blocks_per_chunk, world)


def windowed_groups(
    config: Any, described: Sequence[tuple[int, str, Any]] | None
) -> list[bool] | None:
    """Per group (position in ``config.groups``), whether it keeps only a window of a prefix:
    from the kinds ``KVOffloadConnector`` announced, else from vLLM 0.33's windows; None
    where neither says (vLLM 0.32 behind its stock connector)."""
    kinds = {gid: kind for gid, kind, _w in (described or ())}
    out = []
    for g in config.groups:
        kind = kinds.get(g.group_id)
        if kind is not None:
            out.append(
                kind in ("sliding_window", "mla_sliding_window", "chunked_local")
                or kind.startswith("mamba")
            )
            continue
        known, chunks = compat.group_window_chunks(g)
        if not known:
            return None
        out.append(chunks is not None)
    return out


def _slots(budget: int, slot: int, what: str, world: int, total: int | None = None) -> int:
    if slot <= 0:
        return 0
    n = budget // slot
    if n < 1:
        raise KVOffloadConfigError(
            "kv_connector_extra_config['cpu_bytes']: "
            f"{format_bytes(total if total is not None else budget)} cannot hold one offloaded "
            f"chunk of {what} on {world} worker(s) ({slot} bytes)"
        )
    return n


def group_name(config: Any, group: int) -> str:
    """A short name for a group in log lines: vLLM's group id and its layer count."""
    g = config.groups[group]
    return f"group {g.group_id} ({len(g.layer_names)} layers)"
