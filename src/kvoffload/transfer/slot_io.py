"""CPU slots as the byte blocks the disk and remote tiers store.

A lower tier stores one CPU slot per block, serialised as ``HostPool.read_slots``
lays it out (sub-block, then plane). Where a slot already is one contiguous
run of bytes in the pool (the ``cross_layer`` layout, one plane), the stores
read and write the pool's memory directly; otherwise slots are gathered into
(or scattered from) a staging tensor, one copy.

``tier_fingerprint`` names everything that decides a stored slot's bytes;
the stores fold it into their manifest (disk) and namespace (remote), so
engines whose KV differs never read each other's blocks.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from kvoffload.offload.base import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.transfer.handler import ThreadPoolTransferHandler, Work
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

#: Bump when the serialised form of a slot (or the fingerprint's fields) changes.
SLOT_FORMAT_VERSION = 2

#: The fingerprint's fields, in order; ``tier_fingerprint`` documents each.
FINGERPRINT_FIELDS = (
    "format",
    "model",
    "layers",
    "kv_heads",
    "head_size",
    "block_size",
    "dtype",
    "kv_quant",
    "layout",
    "block_size_factor",
    "hash_fn",
    "hash_seed",
    "tp_rank",
    "tp_size",
)


def _field(value: object) -> str:
    # Values never contain the separators, so the string parses back unambiguously.
    return urllib.parse.quote(str(value), safe="/:@.-_+,")


def tier_fingerprint(
    layout: KVLayout,
    block_size_factor: int = 1,
    *,
    model_id: str = "",
    hash_fn: str = "",
    hash_seed: str | None = "",
    kv_quant: str = "none",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> str:
    """Everything that decides a stored slot's bytes, as one stable ``k=v;...`` string.

    Fields (``FINGERPRINT_FIELDS``): ``format`` (this serialisation's version),
    ``model`` (the model's identity: a weights+config digest, the random
    model's config and seed, or a name and revision; see
    ``kvoffload.engine.model_identity``), the KV geometry (``layers``,
    ``kv_heads``, ``head_size``, ``block_size`` in tokens per GPU block),
    ``dtype`` (the KV cache dtype), ``kv_quant`` (KV quantisation, "none"
    when the cache holds ``dtype`` values as computed), ``layout`` (how a slot
    is laid out: ``KVLayout.kind``) and ``block_size_factor`` (GPU blocks per
    slot), ``hash_fn`` and ``hash_seed`` (the block-hash function and the
    seed of its chain: "random" when the seed is per process), and
    ``tp_rank``/``tp_size`` (each tensor-parallel rank stores its own heads).
    Two engines share a persistent tier's blocks only when every field is equal.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} is not valid")
    g = layout.geometry
    values = {
        "format": f"slot-v{SLOT_FORMAT_VERSION}",
        "model": model_id or "unknown",
        "layers": g.num_layers,
        "kv_heads": g.num_kv_heads,
        "head_size": g.head_size,
        "block_size": g.block_size,
        "dtype": str(g.dtype).removeprefix("torch."),
        "kv_quant": kv_quant or "none",
        "layout": layout.kind,
        "block_size_factor": block_size_factor,
        "hash_fn": hash_fn or "unknown",
        "hash_seed": "random" if hash_seed is None else hash_seed,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
    return ";".join(f"{k}={_field(values[k])}" for k in FINGERPRINT_FIELDS)


def parse_fingerprint(fingerprint: str) -> dict[str, str]:
    """The fields of a ``k=v;...`` fingerprint (values decoded); other strings give {}."""
    out: dict[str, str] = {}
    for part in fingerprint.split(";"):
        k, sep, v = part.partition("=")
        if not sep or not k:
            return {}
        out[k] = urllib.parse.unquote(v)
    return out


def fingerprint_diff(have: str, want: str) -> list[str]:
    """Per differing field, ``"field: 'have' vs 'want'"``; the whole strings when unparseable."""
    a, b = parse_fingerprint(have), parse_fingerprint(want)
    if not a or not b:
        return [] if have == want else [f"fingerprint: {have!r} vs {want!r}"]
    keys = [*b, *(k for k in a if k not in b)]
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


class BlocksMissing(RuntimeError):
    """Some blocks of a copy could not be read or written; the job fails."""


def check_pair(src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
    """A copy pairs blocks one to one: both sides name as many."""
    n_src, n_dst = len(src), len(dst)  # type: ignore[arg-type]
    if n_src != n_dst:
        raise ValueError(f"{src.medium()} -> {dst.medium()} copy of {n_src} blocks into {n_dst}")


class SlotIO:
    """Reads and writes serialised slots of one host pool."""

    def __init__(self, host_pool: HostPool) -> None:
        self.pool = host_pool
        self.slot_bytes = host_pool.slot_bytes
        planes = host_pool.planes
        self._flat: torch.Tensor | None = None
        if len(planes) == 1 and planes[0].is_contiguous():
            # One contiguous plane: slot s is rows s*f .. s*f+f-1, back to back.
            self._flat = planes[0].reshape(host_pool.num_slots, self.slot_bytes)
        self._row_bytes = host_pool.layout.plane_row_bytes
        # torch's index kernels go element by element: 8-byte elements are far
        # faster than bytes, where rows and plane addresses allow them.
        wide = self._row_bytes % 8 == 0 and all(
            p.stride(0) % 8 == 0 and p.data_ptr() % 8 == 0 for p in planes
        )
        self._planes = [p.view(torch.int64) for p in planes] if wide else None

    @property
    def zero_copy(self) -> bool:
        """Whether the stores move bytes straight into and out of the pool."""
        return self._flat is not None

    def views(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray] | None:
        """Per slot, a uint8 view of its bytes in the pool; None when slots are not contiguous."""
        if self._flat is None:
            return None
        ids = self.pool.check_slots(slots)
        flat = self._flat.numpy()
        return [flat[int(s)] for s in ids]

    def gather(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray] | torch.Tensor:
        """The slots' bytes to write down: views when possible, else a gathered copy."""
        views = self.views(slots)
        if views is not None:
            return views
        if self._planes is None:
            return self.pool.read_slots(slots)
        rows = torch.from_numpy(self.pool.sub_block_ids(slots))
        out = torch.empty((rows.numel(), len(self._planes), self._row_bytes), dtype=torch.uint8)
        wide = out.view(torch.int64)
        for p, plane in enumerate(self._planes):
            wide[:, p] = plane.index_select(0, rows)
        return out.view(-1, self.slot_bytes)

    def reader(
        self, slots: Sequence[int] | np.ndarray
    ) -> tuple[list[np.ndarray] | torch.Tensor, bool]:
        """Where a store should put the slots' bytes, and whether a ``scatter`` must follow."""
        views = self.views(slots)
        if views is not None:
            return views, False
        ids = self.pool.check_slots(slots)
        return torch.empty((len(ids), self.slot_bytes), dtype=torch.uint8), True

    def scatter(
        self, slots: Sequence[int] | np.ndarray, staging: torch.Tensor, hit: Sequence[bool]
    ) -> None:
        """Copy the staged rows that were hits into their slots (misses are left alone)."""
        ids = np.asarray(slots, dtype=np.int64)
        mask = np.asarray(hit, dtype=bool)
        if not mask.any():
            return
        if not mask.all():
            ids = ids[mask]
            staging = staging.index_select(0, torch.from_numpy(np.flatnonzero(mask)))
        if self._planes is None:
            self.pool.write_slots(ids, staging)
            return
        rows = torch.from_numpy(self.pool.sub_block_ids(ids))
        src = staging.reshape(rows.numel(), len(self._planes), self._row_bytes).view(torch.int64)
        for p, plane in enumerate(self._planes):
            plane.index_copy_(0, rows, src[:, p])


class SlotTierHandler(ThreadPoolTransferHandler):
    """CPU <-> one lower tier whose store keeps serialised slots (the disk and remote handlers).

    Subclasses set ``store`` (with ``block_bytes`` equal to the pool's slot bytes)
    and ``slots``, name their tier in the class attributes, and supply
    ``write(cpu_spec, tier_spec)`` and ``read(tier_spec, cpu_spec)``, each
    returning per block whether it moved. This base validates jobs and turns a
    partial copy into ``BlocksMissing``; it decides nothing.
    """

    #: The tier's ``LoadStoreSpec`` class and medium name.
    tier_spec: ClassVar[type[LoadStoreSpec]]
    tier_medium: ClassVar[str]
    #: How errors name the tier's blocks ("disk") and a failed write ("written").
    tier_noun: ClassVar[str]
    write_verb: ClassVar[str]

    store: Any
    slots: SlotIO

    def write(self, src: Any, dst: Any) -> list[bool]:
        raise NotImplementedError

    def read(self, src: Any, dst: Any) -> list[bool]:
        raise NotImplementedError

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        """Run one copy; raises ``BlocksMissing`` unless every block moved. Returns bytes."""
        cpu, tier = CPULoadStoreSpec.medium(), self.tier_medium
        if isinstance(src, CPULoadStoreSpec) and isinstance(dst, self.tier_spec):
            ok = self.write(src, dst)
        elif isinstance(src, self.tier_spec) and isinstance(dst, CPULoadStoreSpec):
            ok = self.read(src, dst)
        else:
            raise ValueError(f"cannot copy {src.medium()} -> {dst.medium()} ({cpu}<->{tier} only)")
        bad = len(ok) - sum(ok)
        if bad:
            verb = self.write_verb if dst.medium() == tier else "read"
            raise BlocksMissing(f"{bad} of {len(ok)} {self.tier_noun} blocks could not be {verb}")
        return len(ok) * self.store.block_bytes

    def prepare(self, job_id: int, spec: TransferSpec) -> Work:
        src, dst = spec.src, spec.dst
        cpu, tier = CPULoadStoreSpec.medium(), self.tier_medium
        if spec.media not in ((cpu, tier), (tier, cpu)):
            raise ValueError(
                f"cannot transfer {spec.media[0]} -> {spec.media[1]} ({cpu}<->{tier} only)"
            )
        check_pair(src, dst)
        cpu_spec = dst if isinstance(dst, CPULoadStoreSpec) else src
        self.slots.pool.check_slots(cpu_spec.block_ids)  # type: ignore[attr-defined]
        return lambda: self.copy(src, dst)
