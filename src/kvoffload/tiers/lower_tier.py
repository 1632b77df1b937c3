"""Specs and the manager interface of the tiers below CPU memory (disk, remote).

Lower tiers never exchange bytes with the GPU directly: a block comes up
through a CPU slot (a *promotion*) and goes down from one (a *write-down*).
When a load or store needs such steps, the tiered manager hands the worker a
``TieredLoadStoreSpec``: the CPU slots the GPU side copies, plus the
lower-tier copies to run before and after that copy, in order. Loads and
stores that touch only the CPU tier keep plain ``CPULoadStoreSpec``s.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvoffload.offload.base import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadKey,
)
from kvoffload.offload.media import DISK_MEDIUM, REMOTE_MEDIUM, TIERED_MEDIUM

__all__ = ["DISK_MEDIUM", "REMOTE_MEDIUM", "TIERED_MEDIUM"]  # re-exported: older import path


class DiskLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Disk slots and the keys they hold (the store records and verifies the key per slot)."""

    __slots__ = ("keys",)

    def __init__(self, block_ids: Sequence[int] | np.ndarray, keys: Sequence[OffloadKey]) -> None:
        super().__init__(block_ids)
        self.keys: list[OffloadKey] = list(keys)
        if len(self.keys) != len(self):
            raise ValueError(f"{len(self)} disk slots but {len(self.keys)} keys")

    @staticmethod
    def medium() -> str:
        return DISK_MEDIUM

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DiskLoadStoreSpec):
            return NotImplemented
        return super().__eq__(other) and self.keys == other.keys

    __hash__ = None


class RemoteLoadStoreSpec(LoadStoreSpec):
    """Blocks in the shared remote store, named by key alone (the server places them)."""

    __slots__ = ("keys",)

    def __init__(self, keys: Sequence[OffloadKey]) -> None:
        self.keys: list[OffloadKey] = list(keys)

    @staticmethod
    def medium() -> str:
        return REMOTE_MEDIUM

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemoteLoadStoreSpec):
            return NotImplemented
        return self.keys == other.keys

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RemoteLoadStoreSpec({len(self.keys)} keys)"


@dataclass(frozen=True)
class TierCopy:
    """One lower-tier copy of a tiered job: ``src`` blocks to ``dst``, pairwise.

    ``required``: the job fails when this copy does not fully succeed (a
    promotion the GPU copy reads from). A copy that is not required is best
    effort (a write-down): its failure is logged and the job goes on.
    """

    src: LoadStoreSpec
    dst: LoadStoreSpec
    required: bool


class TieredLoadStoreSpec(LoadStoreSpec):
    """A job that moves bytes through lower tiers as well as the GPU <-> CPU copy.

    The worker runs ``before`` in order, then the GPU <-> CPU copy of ``cpu``
    (the job's CPU slots, in the job's key order), then ``after`` in order
    (only when the GPU <-> CPU copy succeeded). With ``error`` set the job
    must fail at once, with that reason, copying nothing.
    """

    __slots__ = ("after", "before", "cpu", "error")

    def __init__(
        self,
        cpu: CPULoadStoreSpec,
        before: Sequence[TierCopy] = (),
        after: Sequence[TierCopy] = (),
        error: str | None = None,
    ) -> None:
        self.cpu = cpu
        self.before: tuple[TierCopy, ...] = tuple(before)
        self.after: tuple[TierCopy, ...] = tuple(after)
        self.error = error

    @staticmethod
    def medium() -> str:
        return TIERED_MEDIUM

    def __len__(self) -> int:
        return len(self.cpu)

    def __repr__(self) -> str:
        steps = ", ".join(
            f"{c.src.medium()}->{c.dst.medium()}x{len(c.src)}{'!' if c.required else ''}"  # type: ignore[arg-type]
            for c in (*self.before, *self.after)
        )
        return f"TieredLoadStoreSpec(cpu={len(self.cpu)}, steps=[{steps}], error={self.error!r})"


class LowerTierManager(OffloadingManager):
    """The scheduler-side index of a tier below CPU memory.

    Beyond the ``OffloadingManager`` contract: ``stored_mask`` answers for a
    batch of keys at once (one round trip for a remote tier), and ``drop``
    forgets keys whose bytes turned out unusable (a failed promotion), so a
    stale entry is not offered again.

    ``answers_locally``: presence questions cost no I/O (False for a remote
    tier, whose every question is a round trip).
    """

    answers_locally: ClassVar[bool] = True

    @abstractmethod
    def stored_mask(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """``is_stored`` for each key."""

    @abstractmethod
    def drop(self, keys: Sequence[OffloadKey]) -> None:
        """Forget stored ``keys`` (pinned ones when unpinned); unknown ones are ignored."""

    def awaiting(self, key: OffloadKey) -> bool:
        """Whether this tier is still finding out if it holds ``key`` (asked off-thread).

        Local tiers always know: False.
        """
        return False

    def wait_answers(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the answers ``awaiting`` reports; False if some are
        still out. For an engine with nothing else to do this step; local tiers: True at once.
        """
        return True

    def close(self) -> None:
        """Stop any background work (a remote tier's presence thread); local tiers: nothing."""
