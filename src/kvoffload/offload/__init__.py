"""What is stored where in the secondary tiers (scheduler side, no tensors)."""

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
    "make_offload_key",
    "make_policy",
    "offload_key_block_hash",
    "offload_key_group_idx",
    "policy_names",
    "register_policy",
]
