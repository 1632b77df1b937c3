"""The reference engine: a small Llama-style model over paged KV, continuous batching."""

from kvoffload.engine.config import EngineConfig
from kvoffload.engine.llm_engine import LLMEngine, RequestOutput
from kvoffload.engine.request import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
