"""What the tier benchmarks share: byte sizes, timing, batches, keys.

The transfer package imports torch: the byte helpers load it on first use, so
``kvoffload bench tiers --help`` needs none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoffload.offload.base import OffloadKey


# The transfer package imports torch: these load it on first use, not for --help.
def aligned_empty(nbytes: int) -> np.ndarray:
    from kvoffload.transfer.block_buffers import aligned_empty as impl

    return impl(nbytes)


def parse_bytes(value: str | int) -> int:
    from kvoffload.transfer.sizing import parse_bytes as impl

    return impl(value)


def format_bytes(num_bytes: int) -> str:
    from kvoffload.transfer.sizing import format_bytes as impl

    return impl(num_bytes)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def io_figures(
    block_bytes: int, n: int, seconds: dict[str, float], raw_put: str, raw_get: str
) -> dict[str, Any]:
    """GB/s of each timed pass over ``n`` blocks; put and get as shares of their raw baselines."""
    res: dict[str, Any] = {"block_bytes": block_bytes, "blocks": n}
    res.update({f"{k}_gbps": gbps(n * block_bytes, t) for k, t in seconds.items()})
    for op, raw in (("put", raw_put), ("get", raw_get)):
        base = res[f"{raw}_gbps"]
        res[f"{op}_ratio"] = res[f"{op}_gbps"] / base if base else 0.0
    return res


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def batches(n: int, batch: int) -> list[range]:
    return [range(i, min(n, i + batch)) for i in range(0, n, batch)]


def block_keys(n: int, salt: int) -> list[OffloadKey]:
    return [OffloadKey((salt << 40 | i).to_bytes(8, "big") + b"\0\0\0\0") for i in range(n)]
