"""What the scheduler-side connector hands to the worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.offload.base import LoadStoreSpec


@dataclass(frozen=True)
class TransferJob:
    """One copy to run: ``src`` blocks into ``dst`` blocks, named by ``job_id``."""

    job_id: int
    req_id: str
    src: LoadStoreSpec
    dst: LoadStoreSpec
    is_store: bool


@dataclass
class ConnectorMetadata:
    """The step's new jobs, loads first (a request waits on its load)."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores)
