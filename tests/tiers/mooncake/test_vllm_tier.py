"""``KVOffloadMooncakeTier`` inside vLLM 0.33's own tiering (the real spec and manager).

vLLM's ``TieringOffloadingSpec(...).get_manager()`` runs the scheduler side
with the tier named by its public ``type`` / ``module_path``; the test plays
vLLM's scheduler (``tests.integrations.vllm_tier_rig``): a prefix stored,
evicted from the CPU tier by later blocks, looked up (RETRY until presence
is answered) and loaded back bit for bit from the Mooncake Store, with
vLLM's metrics under the tier's label and STORAGE / REMOTE events naming
the store. A second engine (its own spec, same master) loads what the first
stored.
"""

from __future__ import annotations

from tests.tiers.mooncake.required import need_mooncake
from tests.vllm_required import need_vllm

need_vllm()
need_mooncake()

from typing import Any  # noqa: E402

import pytest  # noqa: E402
from vllm.v1.kv_offload.base import Locality, Medium  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadMooncakeTier  # noqa: E402
from kvoffload.tiers.config import TierConfigError  # noqa: E402
from tests.integrations.vllm_tier_rig import MODULE, TierRig, keys_of  # noqa: E402
from tests.tiers.mooncake.cluster import LoopbackMooncake  # noqa: E402

PREFIX = 6
FILLER = 24


def mooncake_tier(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "KVOffloadMooncakeTier", "module_path": MODULE, "mooncake_url": url, **extra}


def test_prefix_is_served_from_mooncake(mooncake: LoopbackMooncake) -> None:
    rig = TierRig([mooncake_tier(mooncake.url, mooncake_namespace="vllm-a")])
    try:
        (tier,) = rig.tiers
        assert isinstance(tier, KVOffloadMooncakeTier)
        assert tier.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED
        prefix = keys_of(PREFIX, tag=b"prompt-mooncake")
        rig.store_many(prefix)
        rig.store_many(keys_of(FILLER, tag=b"filler-mooncake"))  # evicts the prefix from CPU
        rig.settle()
        hits, checks = rig.fetch(prefix)
        assert hits == PREFIX
        assert len(checks) == 2 and all(len(c) == PREFIX and all(c) for c in checks)
        stats = rig.stats()
        assert stats[f"vllm:kv_offload_tiering_read_bytes:('{tier.label}',)"] == (
            PREFIX * rig.row_bytes
        )
        stored = [e for e in rig.events if e.medium is Medium.STORAGE and not e.removed]
        assert stored and all(e.locality is Locality.REMOTE for e in stored)
        assert {e.ownership for e in stored} == {tier.mc.ownership}
        assert tier.mc.ownership.startswith("mooncake:vllm-a:")
    finally:
        rig.close()


def test_a_second_engine_loads_what_the_first_stored(mooncake: LoopbackMooncake) -> None:
    entry = mooncake_tier(mooncake.url, mooncake_namespace="vllm-shared")
    a = TierRig([entry], model="tiny/shared")
    b = TierRig([entry], model="tiny/shared")
    try:
        prefix = keys_of(PREFIX, tag=b"prompt-shared")
        a.store_many(prefix)
        a.settle()
        hits, checks = b.fetch(prefix)
        assert hits == PREFIX
        assert all(all(c) for c in checks)
    finally:
        a.close()
        b.close()


def test_bad_keys_are_one_line(mooncake: LoopbackMooncake) -> None:
    for entry, key in (
        (mooncake_tier("redis://127.0.0.1:1"), "mooncake_url"),
        (mooncake_tier(mooncake.url, mooncake_protocol="udp"), "mooncake_protocol"),
        (mooncake_tier(mooncake.url, redis_url="redis://h:1"), "redis_url"),
        ({"type": "KVOffloadMooncakeTier", "module_path": MODULE}, "mooncake_url"),
    ):
        with pytest.raises(TierConfigError) as info:
            TierRig([entry])
        assert key in str(info.value) and "\n" not in str(info.value)
