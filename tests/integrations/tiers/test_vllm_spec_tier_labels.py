"""Lower tiers built through ``KVOffloadSpec``: labels, hit sources, and ``/dev/shm`` (issue 32).

Behind vLLM's OpenAI server three things were wrong with the disk and Redis
tiers that ``KVOffloadConnector`` / ``KVOffloadSpec`` build (vLLM's own
``TieringOffloadingSpec`` got the first right):

- kvoffload's tier gauges said ``tier="?:KVOffloadDiskTier"`` where vLLM's
  own series on the same server said ``1:KVOffloadDiskTier``;
- Redis hits were counted as ``prompt_tokens_cached_by_source{source="disk"}``:
  vLLM's categories put a remote store under "external_unspecified";
- the CPU tier's region stayed in ``/dev/shm`` for the engine's whole life
  (and after it, when the engine was killed): its name must be gone as soon
  as the worker and the scheduler both mapped it.

The engine here is vLLM's real scheduler and worker-side connector in one
process (``vllm_rig``), both ways in.
"""

from tests.vllm_required import need_vllm

need_vllm()

import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvoffload.integrations.vllm.worker.shm_lifetime import region_path  # noqa: E402
from tests.integrations.vllm_rig import VLLMRig  # noqa: E402

STOCK = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
STOCK_SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm"}
#: Nothing listens there: the Redis tier starts in an outage (a warning), which is all
#: these checks need.
DEAD_REDIS = "redis://127.0.0.1:1/0"


def _build(tmp_path: Path, stock: bool) -> VLLMRig:
    disk = tmp_path / "disk"
    disk.mkdir()
    extra: dict[str, Any] = {
        "cpu_bytes": "1MiB",
        "disk_dir": str(disk),
        "disk_bytes": "4MiB",
        "redis_url": DEAD_REDIS,
    }
    if stock:
        return VLLMRig.build(tmp_path, extra_config={**extra, **STOCK_SPEC}, connector=STOCK)
    return VLLMRig.build(tmp_path, extra_config=extra)


@pytest.fixture(params=["KVOffloadConnector", "OffloadingConnector+KVOffloadSpec"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    rig = _build(tmp_path, stock=request.param != "KVOffloadConnector")
    yield rig
    rig.shutdown()


def test_tier_labels_are_vllms(rig: VLLMRig) -> None:
    manager = rig.manager
    tiers = list(manager.secondary_tiers)
    assert [t.tier_type for t in tiers] == ["KVOffloadDiskTier", "KVOffloadRedisTier"]
    assert [t.label for t in tiers] == ["1:KVOffloadDiskTier", "2:KVOffloadRedisTier"]
    # The very labels vLLM's tiering metrics put on its own series for these tiers.
    tracker = getattr(manager, "_metrics", None)
    if tracker is not None and hasattr(tracker, "tier_label"):
        assert [t.label for t in tiers] == [tracker.tier_label(i)[0] for i in range(len(tiers))]
    # What reaches Prometheus: the manager's stats, every kvoffload series with a real label.
    stats = manager.get_stats()
    keys = [k for k in (dict(stats.reduce()) if stats is not None else {}) if "kvoffload_tier" in k]
    assert any("('2:KVOffloadRedisTier',)" in k for k in keys), keys
    assert not any("?:" in k for k in keys), keys


def test_hit_sources_follow_vllms_categories(rig: VLLMRig) -> None:
    disk, redis_tier = rig.manager.secondary_tiers
    assert disk.cache_hit_source is CacheHitSource.DISK
    assert redis_tier.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED


def test_the_cpu_tier_region_has_no_name_once_the_engine_started(rig: VLLMRig) -> None:
    engine_id = rig.config.kv_transfer_config.engine_id
    path = region_path(engine_id)
    assert not os.path.exists(path), f"{path} outlives the engine if it is killed now"
    # And the tiers still share one memory: a block stored now is served from it.
    prompt = list(range(1, 1 + 4 * 16))
    rig.add(prompt, max_tokens=1)
    rig.run()
    rig.scheduler.reset_prefix_cache()
    rig.add(prompt, max_tokens=1)
    rig.run()
    assert rig.blocks_verified > 0 and not rig.mismatches
