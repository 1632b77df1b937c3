"""Guard for test modules that run real vLLM 0.33 code.

Call ``need_vllm()`` at the top of such a module. Without vLLM installed the module is
skipped with the reason, except where ``KVOFFLOAD_REQUIRE_VLLM=1`` (set by ``.ci/run``):
there a missing vLLM is an error, so CI can never pass by skipping the compatibility tests.
"""

from __future__ import annotations

import importlib
import os

import pytest

VLLM_VERSION_PREFIX = "0.33."


def need_vllm() -> None:
    required = os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1"
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        if required:
            raise RuntimeError(f"KVOFFLOAD_REQUIRE_VLLM=1 but vLLM does not import: {exc}") from exc
        pytest.skip(f"vLLM not installed ({exc}); `make test` installs it", allow_module_level=True)
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(VLLM_VERSION_PREFIX):
        msg = f"these tests target vLLM {VLLM_VERSION_PREFIX}x, found {version}"
        if required:
            raise RuntimeError(msg)
        pytest.skip(msg, allow_module_level=True)
