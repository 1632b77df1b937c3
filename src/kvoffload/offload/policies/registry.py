"""Cache policies by name."""

from __future__ import annotations

from kvoffload.offload.policies.admission import AdmitARCPolicy, AdmitLRUPolicy
from kvoffload.offload.policies.arc import ARCPolicy
from kvoffload.offload.policies.arms import ArmsChainLRUPolicy
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.chain_lru import ChainLRUPolicy
from kvoffload.offload.policies.duel import DuelChainLRUPolicy
from kvoffload.offload.policies.lru import FlatLRUPolicy, LRUPolicy
from kvoffload.offload.policies.policy_duel import PolicyDuel
from kvoffload.offload.policies.queue import QueueArmsPolicy
from kvoffload.offload.policies.s3fifo import S3FIFOPolicy
from kvoffload.offload.policies.sieve import SievePolicy

POLICIES: dict[str, type[CachePolicy]] = {}


def register_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Make ``cls`` available under ``cls.name`` (usable as a class decorator)."""
    name = cls.name
    if name in POLICIES and POLICIES[name] is not cls:
        raise ValueError(f"cache policy {name!r} is already registered")
    POLICIES[name] = cls
    return cls


for _cls in (
    LRUPolicy,
    FlatLRUPolicy,
    ChainLRUPolicy,
    ARCPolicy,
    S3FIFOPolicy,
    SievePolicy,
    AdmitARCPolicy,
    AdmitLRUPolicy,
    DuelChainLRUPolicy,
    ArmsChainLRUPolicy,
    PolicyDuel,
    QueueArmsPolicy,
):
    register_policy(_cls)


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str, capacity: int) -> CachePolicy:
    """A new ``name`` policy for ``capacity`` slots; an unknown name is a ValueError."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; known: {', '.join(policy_names())}"
        ) from None
    return cls(capacity)
