"""What a transfer job is (``TransferSpec``) and how it ended (``TransferResult``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.offload.base import LoadStoreSpec


@dataclass(frozen=True)
class TransferSpec:
    """Copy the blocks named by ``src`` to the places named by ``dst``, pairwise in order."""

    src: LoadStoreSpec
    dst: LoadStoreSpec

    @property
    def media(self) -> tuple[str, str]:
        """``(source medium, destination medium)``, the key handlers are registered under."""
        return (self.src.medium(), self.dst.medium())


def as_transfer_spec(spec: TransferSpec | tuple[LoadStoreSpec, LoadStoreSpec]) -> TransferSpec:
    """Accepts a ``TransferSpec`` or a ``(src, dst)`` pair (vLLM's spelling)."""
    if isinstance(spec, TransferSpec):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        src, dst = spec
        if isinstance(src, LoadStoreSpec) and isinstance(dst, LoadStoreSpec):
            return TransferSpec(src, dst)
    raise TypeError(f"expected a TransferSpec or a (src, dst) pair of LoadStoreSpecs, got {spec!r}")


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one job.

    ``success`` is False when the job was rejected (bad block or slot id,
    mismatched counts, no handler for its media) or its copy raised;
    ``error`` then says why. A failed job's destination must be treated as
    garbage: a failed store's keys are dropped by the manager, a failed
    load's GPU blocks recomputed. ``num_bytes`` is what a successful job
    moved (0 on failure); ``seconds`` runs from submit to completion as
    observed by the handler. ``copy_seconds``: how long the job's copies
    ran, each part (shard, stage) from its start to its end, added over the
    parts (what vLLM's own thread-pool tier reports as a transfer's time);
    ``copy_cpu_seconds``: the CPU time of the threads while they ran them
    (the same, less the time a part's thread waited for a core). Both are
    None where the handler does not time its parts.
    """

    job_id: int
    success: bool
    error: str | None = None
    num_bytes: int = 0
    src_medium: str = ""
    dst_medium: str = ""
    seconds: float = 0.0
    copy_seconds: float | None = None
    copy_cpu_seconds: float | None = None
