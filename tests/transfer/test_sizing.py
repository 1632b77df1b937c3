"""Byte-size parsing, block size factors and CPU slots from a budget."""

from __future__ import annotations

import pytest
import torch

from kvoffload.transfer.layout import KVGeometry
from kvoffload.transfer.sizing import (
    compute_block_size_factor,
    cpu_slot_bytes,
    format_bytes,
    num_cpu_blocks,
    parse_bytes,
)

# 2 layers x 2 (K,V) x 16 tokens x 8 heads x 128 x 2 bytes = 128 KiB per block.
GEOM = KVGeometry(2, 8, 128, 16, torch.bfloat16)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("512 mib", 512 << 20),
        ("64k", 64 << 10),
        ("1.5KiB", 1536),
        ("2GB", 2 * 10**9),
        ("4096", 4096),
        ("10B", 10),
        (" 1 TiB ", 1 << 40),
        (123, 123),
    ],
)
def test_parse_bytes(text: str | int, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0", "positive"),
        ("0GiB", "positive"),
        ("-1GiB", "positive"),
        (-5, "positive"),
        (0, "positive"),
        ("1.3B", "whole number"),
        ("4 GiBs", "unknown unit"),
        ("lots", "not a byte size"),
        ("", "not a byte size"),
        (True, "not a byte size"),
        (1.5, "not a byte size"),
    ],
)
def test_parse_bytes_errors(text: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)  # type: ignore[arg-type]


def test_format_bytes_round_trips_common_sizes() -> None:
    for n in (16 << 10, 256 << 10, 1 << 20, 4 << 20, 3 << 30, 1536, 100):
        assert parse_bytes(format_bytes(n)) == n


def test_num_cpu_blocks() -> None:
    assert GEOM.bytes_per_block == 128 << 10
    assert num_cpu_blocks(1 << 30, GEOM) == 8192
    assert num_cpu_blocks("1GiB", GEOM, block_size_factor=4) == 2048
    assert num_cpu_blocks((128 << 10) * 3 + 5, GEOM) == 3  # the remainder is unused
    assert cpu_slot_bytes(GEOM, 2) == 256 << 10


@pytest.mark.parametrize(
    ("budget", "factor", "match"),
    [
        (0, 1, "positive"),
        (-(1 << 30), 1, "positive"),
        ("64KiB", 1, "smaller than one CPU block"),
        ("200KiB", 2, "smaller than one CPU block"),
        ("1GiB", 0, "block_size_factor must be positive"),
        ("1GiB", -2, "block_size_factor must be positive"),
        ("1GiB", 1.5, "block_size_factor must be an int"),
    ],
)
def test_num_cpu_blocks_errors(budget: int | str, factor: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        num_cpu_blocks(budget, GEOM, factor)  # type: ignore[arg-type]


def test_block_size_factor() -> None:
    assert compute_block_size_factor(64, 16) == 4
    assert compute_block_size_factor(16, 16) == 1
    with pytest.raises(ValueError, match="not a multiple"):
        compute_block_size_factor(24, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        compute_block_size_factor(8, 16)
    with pytest.raises(ValueError, match="positive"):
        compute_block_size_factor(0, 16)
    with pytest.raises(ValueError, match="positive"):
        compute_block_size_factor(16, -16)
