"""Sizing the CPU tier: human byte sizes, block size factors, slots from a byte budget.

A CPU slot holds ``block_size_factor`` consecutive GPU blocks, so one slot is
``block_size_factor * geometry.bytes_per_block`` bytes and a budget holds
``budget // slot_bytes`` slots (the remainder is left unused).
"""

from __future__ import annotations

import math
import re

from kvoffload.transfer.layout import KVGeometry

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def parse_bytes(value: str | int) -> int:
    """Bytes from an int or a human size: "4GiB", "512MiB", "1.5 GB", "64k", "4096".

    Binary units (KiB, MiB, GiB, TiB and the bare K, M, G, T) are powers of
    1024; KB, MB, GB, TB are powers of 1000; case is ignored. The result must
    be a positive whole number of bytes (``ValueError`` otherwise).
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        return _positive_int("byte size", value)
    if not isinstance(value, str):
        raise ValueError(f"not a byte size: {value!r}")
    m = _SIZE_RE.match(value)
    if m is None:
        raise ValueError(f"not a byte size: {value!r} (expected e.g. 4GiB, 512MiB, 1.5GB)")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(
            f"unknown unit {m.group(2)!r} in {value!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        )
    scale = _UNITS[unit]
    if re.fullmatch(r"[+-]?\d+", number):
        total = int(number) * scale
    else:
        amount = float(number) * scale
        if not math.isfinite(amount) or amount != int(amount):
            raise ValueError(f"{value!r} is not a whole number of bytes")
        total = int(amount)
    if total <= 0:
        raise ValueError(f"byte size must be positive, got {value!r}")
    return total


def format_bytes(num_bytes: int) -> str:
    """A short binary-unit rendering: 262144 -> "256KiB", 1536 -> "1.5KiB"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{num_bytes}B"


def compute_block_size_factor(cpu_block_size: int, gpu_block_size: int) -> int:
    """How many GPU blocks one CPU block holds; the CPU block size must be a multiple."""
    cpu = _positive_int("cpu_block_size", cpu_block_size)
    gpu = _positive_int("gpu_block_size", gpu_block_size)
    if cpu % gpu:
        raise ValueError(
            f"cpu_block_size {cpu} is not a multiple of the GPU block size {gpu} "
            f"(a CPU block holds a whole number of GPU blocks)"
        )
    return cpu // gpu


def cpu_slot_bytes(geometry: KVGeometry, block_size_factor: int = 1) -> int:
    """Bytes of one CPU slot: ``block_size_factor`` GPU blocks."""
    return _positive_int("block_size_factor", block_size_factor) * geometry.bytes_per_block


def num_cpu_blocks(
    budget_bytes: int | str, geometry: KVGeometry, block_size_factor: int = 1
) -> int:
    """How many CPU slots fit in ``budget_bytes`` (an int or a human size).

    Raises ``ValueError`` for a non-positive budget or factor, or a budget
    smaller than one slot.
    """
    budget = parse_bytes(budget_bytes)
    slot = cpu_slot_bytes(geometry, block_size_factor)
    n = budget // slot
    if n == 0:
        raise ValueError(
            f"CPU budget of {format_bytes(budget)} ({budget} bytes) is smaller than one CPU "
            f"block of {format_bytes(slot)} ({slot} bytes = {block_size_factor} x "
            f"{geometry.bytes_per_block})"
        )
    return n
