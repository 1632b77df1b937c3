"""The vLLM objects the plug-in reads at its edge, as the shapes it relies on.

vLLM hands the connector and the spec its own config, request, scheduler
output and KV-cache objects. The plug-in reads a few fields of each; these
Protocols name exactly those fields (read-only), so a reader sees what
kvoffload depends on and the type checker checks every use, without
importing vLLM (which the checker does not follow). Fields that only one
vLLM release has are not here: ``compat`` reads those.

Invariant: nothing here is written to; where the plug-in changes a vLLM
object (the connector fills ``kv_connector_extra_config``), it says so at
the place it does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

# -- configuration -------------------------------------------------------------------------


class KVTransferConfigView(Protocol):
    """vLLM's ``KVTransferConfig``: the connector's extra config (None until set)."""

    kv_connector_extra_config: dict[str, Any] | None


class SchedulerConfigView(Protocol):
    @property
    def async_scheduling(self) -> bool | None: ...


class VllmConfigView(Protocol):
    """vLLM's ``VllmConfig`` as the connector reads it."""

    @property
    def kv_transfer_config(self) -> KVTransferConfigView | None: ...

    @property
    def scheduler_config(self) -> SchedulerConfigView: ...


class KVCacheSpecView(Protocol):
    """A KV cache group's spec: bytes of one block's page, tokens per block."""

    @property
    def page_size_bytes(self) -> int: ...

    @property
    def block_size(self) -> int: ...


class KVCacheGroupView(Protocol):
    @property
    def kv_cache_spec(self) -> KVCacheSpecView: ...

    @property
    def layer_names(self) -> Sequence[str]: ...


class KVCacheConfigView(Protocol):
    """vLLM's ``KVCacheConfig``: the engine's KV cache groups, in group-id order."""

    @property
    def kv_cache_groups(self) -> Sequence[KVCacheGroupView]: ...


class GroupOffloadConfigView(Protocol):
    """One group of vLLM's offloading scheduler config (``GroupOffloadConfig``)."""

    @property
    def group_idx(self) -> int: ...

    @property
    def tokens_per_block(self) -> int: ...

    @property
    def hashes_per_chunk(self) -> int: ...


# -- requests and steps ----------------------------------------------------------------------


class RequestView(Protocol):
    """vLLM's ``Request`` as the connector's hooks read it."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...


class NewRequestDataView(Protocol):
    @property
    def req_id(self) -> str: ...


class CachedRequestDataView(Protocol):
    @property
    def resumed_req_ids(self) -> Iterable[str]: ...


class SchedulerOutputView(Protocol):
    """vLLM's ``SchedulerOutput``: who was scheduled, resumed, preempted, finished."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestDataView]: ...

    @property
    def scheduled_cached_reqs(self) -> CachedRequestDataView: ...

    @property
    def preempted_req_ids(self) -> Iterable[str] | None: ...

    @property
    def finished_req_ids(self) -> Iterable[str] | None: ...


# -- the shared CPU region and vLLM's tiering objects (lower tiers) ---------------------------


class SharedRegionView(Protocol):
    """vLLM's ``SharedOffloadRegion`` as ``shm_lifetime.open_shared_region`` returns it."""

    @property
    def is_pinned(self) -> bool: ...

    def create_next_worker_view(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` of every row of this rank's shard, as one tensor."""
        ...

    def cleanup(self) -> None:
        """Unmap the region and release kvoffload's lease on its ``/dev/shm`` name."""
        ...


class PrimaryTierView(Protocol):
    """vLLM's ``CPUPrimaryTierOffloadingManager`` as the spec builds the tiers over it."""

    def get_kv_memoryview(self) -> memoryview: ...

    def shutdown(self) -> None: ...


class SecondaryTierView(Protocol):
    """Any vLLM secondary tier (kvoffload's or vLLM's own), as a failed start stops it."""

    def shutdown(self) -> None: ...
