"""What is stored where in the secondary tiers (scheduler side, no tensors).

The tiered manager (CPU over disk / Redis) lives in ``kvoffload.tiers``; its
name stays importable here, loaded on first use (tiers sits above offload).
"""

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports
from kvoffload.offload.base import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    make_offload_key,
    offload_key_block_hash,
    offload_key_group_idx,
)
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY, CPUOffloadingManager
from kvoffload.offload.policies import (
    POLICIES,
    CachePolicy,
    make_policy,
    policy_names,
    register_policy,
)

if TYPE_CHECKING:
    from kvoffload.tiers.tiered_manager import TieredOffloadingManager

__all__ = [
    "DEFAULT_CACHE_POLICY",
    "POLICIES",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "TieredOffloadingManager",
    "make_offload_key",
    "make_policy",
    "offload_key_block_hash",
    "offload_key_group_idx",
    "policy_names",
    "register_policy",
]


__getattr__ = lazy_exports(__name__, {"TieredOffloadingManager": "kvoffload.tiers.tiered_manager"})
