"""Moved to ``scheduler.policies``; this path stays: vLLM configs name it as a module path."""

from kvoffload._lazy import lazy_exports
from kvoffload.integrations.vllm._exports import EveryName

__getattr__ = lazy_exports(__name__, EveryName("kvoffload.integrations.vllm.scheduler.policies"))
