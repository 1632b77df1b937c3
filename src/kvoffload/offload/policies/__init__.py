"""Cache policies of a tier, by name.

``lru``, ``lru_flat``, ``chain_lru``, ``arc``, ``s3fifo``, ``sieve``, ``arc_admit``,
``lru_admit``, ``chain_duel``, ``chain_arms``, ``policy_duel`` (chain LRU's admission
arms or ARC, whichever a duel of shadow tiers favours) and ``queue_arms`` (queue hints
around ``policy_duel``: the default); see ``registry``.
"""

from kvoffload.offload.policies.admission import AdmitARCPolicy, AdmitLRUPolicy
from kvoffload.offload.policies.arc import ARCPolicy
from kvoffload.offload.policies.arms import ArmsChainLRUPolicy
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.chain_lru import ChainLRUPolicy
from kvoffload.offload.policies.duel import DuelChainLRUPolicy
from kvoffload.offload.policies.lru import FlatLRUPolicy, LRUPolicy
from kvoffload.offload.policies.policy_duel import PolicyDuel
from kvoffload.offload.policies.queue import QueueArmsPolicy, QueueAwarePolicy
from kvoffload.offload.policies.registry import (
    POLICIES,
    make_policy,
    policy_names,
    register_policy,
)
from kvoffload.offload.policies.s3fifo import S3FIFOPolicy
from kvoffload.offload.policies.sieve import SievePolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "AdmitARCPolicy",
    "AdmitLRUPolicy",
    "ArmsChainLRUPolicy",
    "CachePolicy",
    "ChainLRUPolicy",
    "DuelChainLRUPolicy",
    "FlatLRUPolicy",
    "LRUPolicy",
    "PolicyDuel",
    "QueueArmsPolicy",
    "QueueAwarePolicy",
    "S3FIFOPolicy",
    "SievePolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]
