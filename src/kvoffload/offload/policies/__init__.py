"""Cache policies of a tier: the contract, the simple policies, the default's layers.

- ``base``: the contract every policy implements (``CachePolicy``), queue and
  session hints included;
- ``registry``: the menu of names a user picks from (``policy_names``,
  ``policy_menu``, ``make_policy``; see there for when to pick each);
- the simple policies: ``lru`` (``LRUPolicy``, vLLM's; ``FlatLRUPolicy``, its
  chain-unaware order, the reference the manager's tests check both against),
  ``arc`` (``ARCPolicy``, vLLM's) and ``admission`` (second-sighting admission
  in front of LRU or ARC, as vLLM's ``store_threshold=2``; its ``Sightings``
  counter is the vLLM plug-in's ``store_threshold`` too);
- ``default``: the default policy (``queue_arms``), one module per layer in
  the order a request meets them (queue hints, the duel of structures, the
  admission arms, their shadows, the chain-aware LRU list, the ARC structure).
"""

from kvoffload.offload.policies.admission import AdmitARCPolicy, AdmitLRUPolicy
from kvoffload.offload.policies.arc import ARCPolicy
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.default import (
    ArmsChainLRUPolicy,
    ChainLRUPolicy,
    PolicyDuel,
    QueueArmsPolicy,
    QueueAwarePolicy,
)
from kvoffload.offload.policies.lru import FlatLRUPolicy, LRUPolicy
from kvoffload.offload.policies.registry import (
    BUILDING_BLOCKS,
    POLICIES,
    all_policies,
    make_policy,
    policy_menu,
    policy_names,
    register_policy,
)

__all__ = [
    "BUILDING_BLOCKS",
    "POLICIES",
    "ARCPolicy",
    "AdmitARCPolicy",
    "AdmitLRUPolicy",
    "ArmsChainLRUPolicy",
    "CachePolicy",
    "ChainLRUPolicy",
    "FlatLRUPolicy",
    "LRUPolicy",
    "PolicyDuel",
    "QueueArmsPolicy",
    "QueueAwarePolicy",
    "all_policies",
    "make_policy",
    "policy_menu",
    "policy_names",
    "register_policy",
]
