"""``TierConfig.from_mapping`` reads every key of its schema (issue 32, contract b).

A key dropped from one of ``from_mapping``'s loops used to pass every test
(``redis_async_presence`` was removed and nothing failed): the value fell
back to its default without a word. Here every key of ``TIER_KEYS`` is given
a value that differs from the field's default, from JSON-typed and from
string-typed sources, and must come back out of the built ``TierConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvoffload.tiers.config import TIER_KEYS, TierConfig

#: A non-default value per field, as a JSON source gives it and as a string source does,
#: and what the built ``TierConfig`` holds for it.
NON_DEFAULT: dict[str, tuple[Any, str, Any]] = {
    "disk_dir": ("/var/kv", "/var/kv", "/var/kv"),
    "disk_bytes": (3 << 30, "3GiB", 3 << 30),
    "disk_blocks": (17, "17", 17),
    "redis_url": ("redis://kv.example:6380/3", "redis://kv.example:6380/3", None),
    "redis_namespace": ("ns-contract", "ns-contract", "ns-contract"),
    "redis_ttl_s": (42.5, "42.5", 42.5),
    "redis_timeout_s": (1.25, "1.25", 1.25),
    "write_mode": ("write_through", "write_through", "write_through"),
    "num_threads": (5, "5", 5),
    "direct_io": (True, "true", True),
    "enable_events": (False, "false", False),
    "redis_async_presence": (False, "false", False),
    "mooncake_url": ("mooncakestore://mc.example:50051", "mooncakestore://mc.example:50051", None),
    "mooncake_namespace": ("mc-contract", "mc-contract", "mc-contract"),
    "mooncake_metadata": ("http://mc.example:8080/metadata",) * 3,
    "mooncake_protocol": ("rdma", "rdma", "rdma"),
    "mooncake_segment_bytes": (1 << 30, "1GiB", 1 << 30),
    "mooncake_local_buffer_bytes": (1 << 20, "1MiB", 1 << 20),
}
#: Keys that exclude each other (both are the shared remote tier): checked one at a time.
ALONE = ("mooncake_url",)


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(TierConfig) if f.name != "where"}


def test_the_schema_is_the_dataclass() -> None:
    """Every field is a key (plus the ``write_through`` alias), and every key is tested here."""
    assert set(TIER_KEYS) == set(_fields()) | {"write_through"}
    assert set(NON_DEFAULT) == set(_fields())


def test_the_values_here_are_not_the_defaults() -> None:
    for name, field in _fields().items():
        assert NON_DEFAULT[name][0] != field.default, name


@pytest.mark.parametrize("source", ["json", "strings"])
def test_every_key_round_trips(source: str) -> None:
    column = 0 if source == "json" else 1
    mapping = {name: values[column] for name, values in NON_DEFAULT.items() if name not in ALONE}
    config = TierConfig.from_mapping(mapping, where="extra")
    assert config is not None
    for name, (given, _, expected) in NON_DEFAULT.items():
        if name in ALONE:
            continue
        got = getattr(config, name)
        if name == "redis_url":
            assert got is not None and "kv.example:6380/3" in got, got
        else:
            assert got == expected, f"{name}: gave {given!r}, got {got!r}"
        assert got != _fields()[name].default, name


#: The smallest mapping beside which a key is valid on its own.
BESIDE: dict[str, dict[str, Any]] = {
    "disk_dir": {"disk_bytes": "1GiB"},
    "disk_bytes": {"disk_dir": "/var/kv"},
    "disk_blocks": {"disk_dir": "/var/kv"},
}


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_key_alone_reaches_the_config(name: str) -> None:
    """One key at a time beside a minimal tier: nothing else can mask a dropped key."""
    base = BESIDE.get(name, {"disk_dir": "/var/kv", "disk_bytes": "1GiB"})
    given, _, expected = NON_DEFAULT[name]
    config = TierConfig.from_mapping({**base, name: given})
    assert config is not None
    got = getattr(config, name)
    if name == "redis_url":
        assert got is not None and "kv.example:6380/3" in got, got
    elif name == "mooncake_url":
        assert got == given, got
    else:
        assert got == expected, f"{name}: gave {given!r}, got {got!r}"


@pytest.mark.parametrize(("value", "mode"), [(True, "write_through"), ("false", "write_back")])
def test_the_write_through_alias(value: object, mode: str) -> None:
    mapping = {"disk_dir": "/var/kv", "disk_bytes": 1 << 30, "write_through": value}
    config = TierConfig.from_mapping(mapping)
    assert config is not None and config.write_mode == mode
