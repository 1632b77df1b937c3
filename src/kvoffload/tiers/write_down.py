"""The copies that move blocks down the stack of lower tiers (write-downs).

When a tier makes room it evicts victims; in write-back mode they are not
lost but written to the next tier down, whose own victims cascade further.
``write_down`` plans those copies for one set of keys: the next tier's
victims move on first (their slots are then free for this write), and keys
a tier already has are only touched. Copies are best effort (not
``required``): a failed write-down is at worst a later miss.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.offload.base import BlockIDsLoadStoreSpec, LoadStoreSpec, OffloadKey
from kvoffload.tiers.lower_tier import (
    DiskLoadStoreSpec,
    LowerTierManager,
    RemoteLoadStoreSpec,
    TierCopy,
)
from kvoffload.tiers.tiered_records import TierKeys


def subset_spec(
    spec: LoadStoreSpec, keys: Sequence[OffloadKey], sub: Sequence[OffloadKey]
) -> LoadStoreSpec:
    """The part of ``spec`` (aligned with ``keys``) that holds ``sub``, in ``sub``'s order."""
    if isinstance(spec, RemoteLoadStoreSpec):
        return RemoteLoadStoreSpec(sub)
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"cannot take a subset of {spec!r}")
    pos = {k: i for i, k in enumerate(keys)}
    ids = spec.block_ids[np.fromiter((pos[k] for k in sub), np.int64, len(sub))]
    if isinstance(spec, DiskLoadStoreSpec):
        return DiskLoadStoreSpec(ids, sub)
    return type(spec)(ids)


def write_down(
    lower: Sequence[LowerTierManager], keys: list[OffloadKey], src: LoadStoreSpec, level: int
) -> tuple[list[TierCopy], TierKeys]:
    """Copies that move ``keys`` (now at ``src``) into ``lower[level]``, victims first.

    Returns the copies in the order they must run and the (tier, keys)
    stores they started. Keys the tier already has are only touched; when
    it cannot make room (all pinned) they are not written anywhere.
    """
    if level >= len(lower) or not keys:
        return [], []
    tier = lower[level]
    out = tier.prepare_store(keys)
    if out is None:
        return [], []
    have = set(out.keys_to_store)
    already = [k for k in keys if k not in have]
    if already:
        tier.touch(already)
    copies: list[TierCopy] = []
    started: TierKeys = []
    if out.evicted_keys and out.evicted_spec is not None:
        # The tier's victims move on before this write reuses their slots.
        copies, started = write_down(lower, list(out.evicted_keys), out.evicted_spec, level + 1)
    if out.keys_to_store:
        copies.append(
            TierCopy(subset_spec(src, keys, out.keys_to_store), out.store_spec, required=False)
        )
        started.append((tier, list(out.keys_to_store)))
    return copies, started
