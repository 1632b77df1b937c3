"""TierConfig: one value, checked once, built the same from every front end."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.engine.config import EngineConfig
from kvoffload.tiers.config import TierConfig, TierConfigError, TierIdentity, parse_redis_url


def test_from_mapping_parses_sizes_urls_and_booleans() -> None:
    c = TierConfig.from_mapping(
        {
            "disk_dir": "/tmp/kv",
            "disk_bytes": "1TiB",
            "redis_url": "valkey://h:6379/0",
            "write_through": "true",
            "redis_timeout_s": "0.25",
            "num_threads": 4,
        },
        where="extra",
    )
    assert c is not None
    assert c.disk_bytes == 1 << 40
    assert c.redis_url == "redis://h:6379/0"
    assert c.write_mode == "write_through" and c.write_through
    assert c.redis_timeout_s == 0.25 and c.num_threads == 4
    assert c.has_disk and c.has_redis


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://:pw@h:6380/1",
        "unix:///tmp/redis.sock",
        "redis+cluster://a:7000,b:7001",
    ],
)
def test_every_url_the_cli_takes(url: str) -> None:
    assert parse_redis_url(url).split("://")[1] == url.split("://")[1]


@pytest.mark.parametrize(
    ("mapping", "key"),
    [
        ({"disk_dir": "/x"}, "disk_bytes"),
        ({"disk_bytes": "1GiB"}, "disk_bytes"),
        ({"disk_dir": "/x", "disk_bytes": "lots"}, "disk_bytes"),
        ({"redis_url": "http://h"}, "redis_url"),
        ({"redis_url": "redis://h", "redis_timeout_s": -1}, "redis_timeout_s"),
        ({"redis_url": "redis://h", "write_mode": "sometimes"}, "write_mode"),
        ({"redis_url": "redis://h", "num_threads": 0}, "num_threads"),
        ({"redis_url": "redis://h", "direct_io": "maybe"}, "direct_io"),
        ({"redis_url": "redis://h", "colour": "blue"}, "colour"),
        ({"write_through": True}, "write_through"),
    ],
)
def test_errors_are_one_line_naming_the_key(mapping: dict[str, object], key: str) -> None:
    with pytest.raises(TierConfigError) as e:
        TierConfig.from_mapping(mapping, where="cfg")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cfg[{key!r}]"), msg


def test_no_lower_tier_is_none_and_a_bare_value_is_refused() -> None:
    assert TierConfig.from_mapping({"write_through": False}) is None
    with pytest.raises(TierConfigError, match="no lower tier"):
        TierConfig()


def test_frozen_and_replace_checks_again() -> None:
    c = TierConfig(redis_url="redis://h:1/0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.redis_url = "x"  # type: ignore[misc]
    with pytest.raises(TierConfigError, match="num_threads"):
        c.replace(num_threads=-2)


def test_disk_slots_counts_whole_slots() -> None:
    c = TierConfig(disk_dir="/x", disk_bytes="10KiB")  # type: ignore[arg-type]
    assert c.disk_slots(4096) == 2
    with pytest.raises(TierConfigError, match="smaller than one block"):
        c.disk_slots(1 << 20)
    assert TierConfig(disk_dir="/x", disk_blocks=7).disk_slots(4096) == 7


def test_engine_config_builds_the_same_value() -> None:
    e = EngineConfig(
        disk_dir="/x", num_disk_blocks=5, redis_url="valkey://h:1/0", write_through=True
    )
    c = e.tier_config()
    assert c == TierConfig(
        disk_dir="/x",
        disk_blocks=5,
        redis_url="redis://h:1/0",
        write_mode="write_through",
        enable_events=False,
        redis_async_presence=True,  # the reference connector defers while presence is asked
    )
    assert EngineConfig().tier_config() is None
    with pytest.raises(ValueError, match="redis_url"):
        EngineConfig(redis_url="http://nope")


def test_identity_is_checked() -> None:
    with pytest.raises(TierConfigError, match="model_id"):
        TierIdentity(model_id="", hash_fn="sha256")
    with pytest.raises(TierConfigError, match="rank 2 of 2"):
        TierIdentity(model_id="m", hash_fn="sha256", tp_rank=2, tp_size=2)


def test_the_cli_builds_it_with_a_byte_budget(tmp_path) -> None:
    import argparse

    from kvoffload.cli.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--disk-dir", str(tmp_path), "--disk-bytes", "1GiB"])
    c = engine_config_from_args(args, store_mode="eager").tier_config()
    assert c is not None
    assert (c.disk_dir, c.disk_bytes, c.disk_blocks) == (str(tmp_path), 1 << 30, None)
    assert c.redis_url is None
    with pytest.raises(ValueError, match="disk_bytes needs disk_dir"):
        EngineConfig(disk_bytes=1 << 20)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (" TRUE ", True), ("false", False), ("1", True), (0, False)],
)
def test_one_boolean_parser(value: object, expected: bool) -> None:
    from kvoffload.tiers.config import parse_bool

    assert parse_bool(value) is expected


@pytest.mark.parametrize("value", ["maybe", 2, 1.5, ""])
def test_a_bad_boolean_names_the_key_and_the_value(value: object) -> None:
    with pytest.raises(TierConfigError) as e:
        TierConfig.from_mapping({"redis_url": "redis://h", "direct_io": value}, where="cfg")
    assert str(e.value) == f"cfg['direct_io']: expected true or false, got {value!r}"
