"""The default policy (``queue_arms``), one layer per module, in the order a request meets them.

1. ``queue``: queue and session hints. Keys a waiting request needs are held
   (the one needed farthest ahead goes first, Belady's bypass declines a
   store that would push out a key needed sooner); continue marks are a soft
   priority. Without hints it forwards every call to the layer below.
2. ``policy_duel``: which structure holds the keys: the LRU structure with
   admission arms, or an ARC structure, moved to while ARC's shadow leads.
3. ``arms_duel``: the LRU structure's admission (admit all, second sightings,
   or a bimodal trickle against loops), chosen by the shadows' scores and by
   the real tier's first sightings (the first-sighting verdict).
4. ``shadow_tier``: the four sampled shadow tiers the duel scores (all,
   second sighting, BIP, ARC), replayed call by call.
5. ``arms``: ``ArmsChainLRUPolicy`` (chain-aware LRU with the three arms and
   their rejects), which ``arms_duel`` specialises.
6. ``chain_lru``: the chain-aware LRU list itself (a chain is evicted from its
   tail; a continuation is stored behind its parent).
7. ``arc_arm``: the ARC structure of layer 2.

Every class here is importable and may be handed to ``CPUOffloadingManager``
as ``cache_policy``; only the default itself is a registered name.
"""

from kvoffload.offload.policies.default.arc_arm import ArcArm
from kvoffload.offload.policies.default.arms import ArmsChainLRUPolicy
from kvoffload.offload.policies.default.arms_duel import ArmsDuel
from kvoffload.offload.policies.default.chain_lru import ChainLRUPolicy
from kvoffload.offload.policies.default.policy_duel import PolicyDuel
from kvoffload.offload.policies.default.queue import QueueArmsPolicy, QueueAwarePolicy
from kvoffload.offload.policies.default.shadow_tier import ShadowTier

__all__ = [
    "ArcArm",
    "ArmsChainLRUPolicy",
    "ArmsDuel",
    "ChainLRUPolicy",
    "PolicyDuel",
    "QueueArmsPolicy",
    "QueueAwarePolicy",
    "ShadowTier",
]
