"""The menu: cache policies a user picks by name, each with when to pick it.

Only policies a user has a reason to choose are names: the default, vLLM's
two (``lru``, ``arc``: the same decisions as vLLM 0.33's, for comparison or
a known-good fallback) and any that leads somewhere in the held-out suite
(``kvoffload bench offload --suite``). The building blocks a user composes
(``BUILDING_BLOCKS``: chain-aware LRU, second-sighting admission in front of
LRU or ARC) and the default's layers stay importable classes: ``make_policy``
and ``CPUOffloadingManager(cache_policy=...)`` take such a class as well as a
name. What no one composed or picked is gone (``chain_duel``, an earlier stage
of the default; S3-FIFO; SIEVE, which led the loop family only beside chain-aware
LRU): their suite figures are in the git history.
"""

from __future__ import annotations

from kvoffload.offload.policies.admission import AdmitARCPolicy, AdmitLRUPolicy
from kvoffload.offload.policies.arc import ARCPolicy
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.default import (
    ArmsChainLRUPolicy,
    ChainLRUPolicy,
    QueueArmsPolicy,
)
from kvoffload.offload.policies.lru import LRUPolicy

POLICIES: dict[str, type[CachePolicy]] = {}
#: Name -> one line on when to pick it (``--policy`` help and the docs print these).
WHEN: dict[str, str] = {}


def register_policy(cls: type[CachePolicy], when: str = "") -> type[CachePolicy]:
    """Make ``cls`` available under ``cls.name``, with ``when`` to pick it."""
    name = cls.name
    if name in POLICIES and POLICIES[name] is not cls:
        raise ValueError(f"cache policy {name!r} is already registered")
    POLICIES[name] = cls
    WHEN[name] = when
    return cls


register_policy(
    QueueArmsPolicy,
    "the default: keeps what queued requests need (with queue hints), otherwise duels "
    "chain-aware LRU's admission arms against ARC on sampled shadow tiers",
)
register_policy(
    ArmsChainLRUPolicy,
    "chain-aware LRU whose admission (all, second sightings, a trickle against loops) "
    "follows sampled shadows, no ARC and no queue hints: without hints it trails vLLM's "
    "best less than the default on chat and mixed traces of the suite",
)
register_policy(
    LRUPolicy,
    "least recently used, as vLLM's lru: a baseline, or where every block is read again soon",
)
register_policy(
    ARCPolicy,
    "adaptive replacement, after vLLM's arc: a popular set survives scans; in the suite "
    "it leads on RAG traces (popular documents behind one-off questions)",
)


def policy_names() -> list[str]:
    return sorted(POLICIES)


#: Complete policies that are not names, the blocks a user composes: chain-aware LRU (the
#: default's list) and second-sighting admission (vLLM's ``store_threshold=2``) in front of
#: LRU or ARC. Importable, accepted by ``make_policy``, covered by the contract tests.
BUILDING_BLOCKS: tuple[type[CachePolicy], ...] = (
    ChainLRUPolicy,
    AdmitARCPolicy,
    AdmitLRUPolicy,
)


def all_policies() -> list[str | type[CachePolicy]]:
    """Every registered name, then every building block (what contract tests run)."""
    return [*policy_names(), *(c for c in BUILDING_BLOCKS if c not in POLICIES.values())]


def policy_menu() -> str:
    """``name: when`` for each registered policy, the default first, one per line."""
    from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY

    names = sorted(POLICIES, key=lambda n: (n != DEFAULT_CACHE_POLICY, n))
    return "\n".join(f"{n}: {WHEN[n]}" for n in names)


def make_policy(name: str | type[CachePolicy], capacity: int) -> CachePolicy:
    """A new policy for ``capacity`` slots: a registered name, or a ``CachePolicy`` class
    (a building block); an unknown name is a ValueError naming the known ones."""
    if isinstance(name, type) and issubclass(name, CachePolicy):
        return name(capacity)
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown cache policy {name!r}; known: {', '.join(policy_names())}"
        ) from None
    return cls(capacity)
