"""``--redis-url`` accepts exactly what the Redis tier accepts (one parser for both)."""

from __future__ import annotations

import argparse

import pytest

from kvoffload.cli.argtypes import redis_url
from kvoffload.tiers.redis.store import normalize_url


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://cache.example:6380",
        "valkey://127.0.0.1:6379/2",
        "unix:///run/redis.sock",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
    ],
)
def test_flag_accepts_what_the_tier_accepts(url: str) -> None:
    assert redis_url(url) == normalize_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://127.0.0.1:6379/0",
        "redis://",
        "redis://h:0",
        "redis://h:6379/x",
        "redis+cluster://",
    ],
)
def test_flag_refuses_what_the_tier_refuses(url: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        redis_url(url)
    if url:
        with pytest.raises(ValueError):
            normalize_url(url)
