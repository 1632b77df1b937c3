"""The reference engine: a small Llama-style model over paged KV, continuous batching.

Names are imported on first use (``kvoffload._lazy``), so that ``kvoffload.engine.config``
(the CLI's flags and defaults) can be read without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _WHERE)
