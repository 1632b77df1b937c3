"""``KVOffloadSpec``'s extra config with lower tiers, and its scheduler side alone in a process."""

from tests.vllm_required import need_vllm

need_vllm()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadConfigError, parse_settings  # noqa: E402
from tests.conftest_redis import free_port  # noqa: E402


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://cache.example:6380/1",
        "valkey://127.0.0.1:6379",
        "unix:///run/redis.sock",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
    ],
)
def test_redis_url_takes_what_the_cli_takes(url: str) -> None:
    settings = parse_settings({"cpu_bytes": "1GiB", "redis_url": url})
    assert settings.redis_url is not None
    (entry,) = settings.secondary_tiers()
    assert entry["type"] == "KVOffloadRedisTier" and entry["redis_url"] == settings.redis_url


@pytest.mark.parametrize("url", ["localhost:6379", "http://h:1", "redis+cluster://", ""])
def test_a_bad_redis_url_is_one_line_naming_the_key(url: str) -> None:
    with pytest.raises(KVOffloadConfigError) as info:
        parse_settings({"cpu_bytes": "1GiB", "redis_url": url})
    assert "'redis_url'" in str(info.value) and "\n" not in str(info.value)


def test_lower_tiers_become_vllm_secondary_tiers_disk_first() -> None:
    settings = parse_settings(
        {
            "cpu_bytes": "1GiB",
            "disk_dir": "/nvme/kv",
            "disk_bytes": "1TiB",
            "redis_url": "redis://h:6379/0",
            "write_through": True,
            "tier_poll_interval_s": "0.002",
        }
    )
    disk, redis = settings.secondary_tiers()
    assert disk == {
        "type": "KVOffloadDiskTier",
        "module_path": "kvoffload.integrations.vllm",
        "disk_dir": "/nvme/kv",
        "disk_bytes": 1 << 40,
    }
    assert redis["type"] == "KVOffloadRedisTier"
    assert settings.tier_poll_interval_s == 0.002
    assert settings.tier_config() is not None


def test_cache_policy_module_path_is_vllms_factory_with_lower_tiers_only() -> None:
    settings = parse_settings(
        {
            "cpu_bytes": "1GiB",
            "disk_dir": "/d",
            "disk_bytes": "1GiB",
            "eviction_policy": "KVOffloadLRUPolicy",
            "cache_policy_module_path": "kvoffload.integrations.vllm.policies",
        }
    )
    assert settings.vllm_eviction_policy == "KVOffloadLRUPolicy"
    assert settings.cache_policy_module_path == "kvoffload.integrations.vllm.policies"
    with pytest.raises(KVOffloadConfigError, match="'cache_policy_module_path'"):
        parse_settings(
            {"cpu_bytes": "1GiB", "eviction_policy": "X", "cache_policy_module_path": "m"}
        )
    with pytest.raises(KVOffloadConfigError, match="needs eviction_policy"):
        parse_settings(
            {
                "cpu_bytes": "1GiB",
                "disk_dir": "/d",
                "disk_bytes": "1GiB",
                "cache_policy_module_path": "m",
            }
        )


def test_the_scheduler_side_builds_its_tiers_with_no_worker_in_its_process(tmp_path: Path) -> None:
    """Under vLLM's multiprocess executor the scheduler's process holds no worker: lower
    tiers used to be refused there ("uniproc only"); now the scheduler side owns them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvoffload.integrations.vllm.scheduler.tiering import KVOffloadTieringManager
    from tests.integrations.vllm_rig import kv_cache_config, vllm_config, write_tiny_llama

    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {
        "cpu_bytes": "1MiB",
        "disk_dir": str(disk),
        "disk_bytes": "1MiB",
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",  # nobody there: starts in an outage
    }
    config = vllm_config(write_tiny_llama(tmp_path / "m"), 12, extra)
    with set_current_vllm_config(config):
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config(12)
        )
    try:
        manager = connector.connector_scheduler.manager
        assert isinstance(manager, KVOffloadTieringManager)
        assert [type(t).__name__ for t in manager.secondary_tiers] == [
            "KVOffloadDiskTier",
            "KVOffloadRedisTier",
        ]
    finally:
        connector.shutdown()


def test_lower_tiers_bring_vllms_tiering_metrics_and_the_tiers_own() -> None:
    from kvoffload.integrations.vllm import KVOffloadSpec

    extra = {
        "cpu_bytes": "1GiB",
        "disk_dir": "/d",
        "disk_bytes": "1GiB",
        "redis_url": "redis://h/0",
    }
    names = set(KVOffloadSpec.build_metric_definitions(extra))
    assert "vllm:kv_offload_tiering_chunk_hits" in names
    assert "vllm:kv_offload_tiering_promotion_latency_seconds" in names
    assert "vllm:kvoffload_tier_checksum_failures" in names
    assert KVOffloadSpec.build_metric_definitions({"cpu_bytes": "1GiB"}) == {}
    assert "tier" in KVOffloadSpec.config_info_keys(extra)


def test_a_second_engine_in_one_process_registers_the_tier_metrics_again() -> None:
    """A new engine's stat logger unregisters the previous engine's collectors (vLLM's
    own ``unregister_vllm_metrics``), then registers every definition again."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
    )
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from kvoffload.integrations.vllm import KVOffloadSpec

    extra = {"cpu_bytes": "1GiB", "disk_dir": "/d", "disk_bytes": "1GiB"}
    definitions = KVOffloadSpec.build_metric_definitions(extra)
    for _engine in range(2):
        unregister_vllm_metrics()
        for name, meta in definitions.items():
            if isinstance(meta, OffloadingCounterMetadata):
                kind: type = Counter
            elif isinstance(meta, OffloadingGaugeMetadata):
                kind = Gauge
            else:
                kind = Histogram
            kind(name, meta.documentation, labelnames=list(meta.labelnames))
    unregister_vllm_metrics()


@pytest.mark.parametrize("value", ["maybe", 2, None])
def test_a_bad_boolean_names_the_extra_config_key(value: object) -> None:
    with pytest.raises(KVOffloadConfigError) as info:
        parse_settings({"cpu_bytes": "1GiB", "write_through": value})
    assert str(info.value) == (
        f"kv_connector_extra_config['write_through']: expected true or false, got {value!r}"
    )
    assert parse_settings({"cpu_bytes": "1GiB", "write_through": " False "}).write_through is False
