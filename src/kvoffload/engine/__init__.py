"""The reference engine: a small Llama-style model over paged KV, continuous batching.

Names are imported on first use (PEP 562), so that ``kvoffload.engine.config``
(the CLI's flags and defaults) can be read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.engine.config import EngineConfig
    from kvoffload.engine.llm_engine import LLMEngine, RequestOutput
    from kvoffload.engine.request import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

_WHERE = {
    "EngineConfig": "kvoffload.engine.config",
    "LLMEngine": "kvoffload.engine.llm_engine",
    "RequestOutput": "kvoffload.engine.llm_engine",
    "SamplingParams": "kvoffload.engine.request",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
