"""kvoffload inside vLLM 0.33: a KV-connector plug-in (optional extra ``kvoffload[vllm]``).

Two public names, for ``--kv-transfer-config`` (see docs/vllm.md):

- ``KVOffloadSpec``: an ``OffloadingSpec`` for vLLM's stock
  ``OffloadingConnector`` (``"spec_name": "KVOffloadSpec"``,
  ``"spec_module_path": "kvoffload.integrations.vllm"``);
- ``KVOffloadConnector``: the connector with that spec preselected and vLLM's
  load-failure recovery wired (``"kv_connector": "KVOffloadConnector"``,
  ``"kv_connector_module_path": "kvoffload.integrations.vllm"``).

kvoffload's cache policies also run inside vLLM's own CPU tier as
``KVOffload<Name>Policy`` classes (``"eviction_policy"`` with
``"cache_policy_module_path": "kvoffload.integrations.vllm"``; see ``policies``).

Importing these names imports vLLM; the core ``kvoffload`` package never
does. They are resolved on first use (PEP 562), so the worker module alone
(``kvoffload.integrations.vllm.worker``) needs only vLLM's
``vllm.v1.kv_offload.base``: the GPU check runs it on a machine without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.integrations.vllm.connector import KVOffloadConnector
    from kvoffload.integrations.vllm.manager import KVOffloadJobSpec, KVOffloadManager
    from kvoffload.integrations.vllm.policies import KVOffloadPolicy, KVOffloadVLLMPolicy
    from kvoffload.integrations.vllm.settings import (
        KVOffloadConfigError,
        KVOffloadSettings,
        parse_settings,
    )
    from kvoffload.integrations.vllm.spec import KVOffloadSpec
    from kvoffload.integrations.vllm.tiers.disk import KVOffloadDiskTier
    from kvoffload.integrations.vllm.tiers.redis import KVOffloadRedisTier
    from kvoffload.integrations.vllm.worker import KVOffloadWorker

_WHERE: dict[str, str] = {
    "KVOffloadConnector": "connector",
    "KVOffloadJobSpec": "manager",
    "KVOffloadManager": "manager",
    "KVOffloadConfigError": "settings",
    "KVOffloadSettings": "settings",
    "parse_settings": "settings",
    "KVOffloadSpec": "spec",
    "KVOffloadDiskTier": "tiers.disk",
    "KVOffloadRedisTier": "tiers.redis",
    "KVOffloadWorker": "worker",
    "KVOffloadPolicy": "policies",
    "KVOffloadVLLMPolicy": "policies",
    "POLICY_CLASSES": "policies",
}

__all__ = [
    "KVOffloadConfigError",
    "KVOffloadConnector",
    "KVOffloadDiskTier",
    "KVOffloadJobSpec",
    "KVOffloadManager",
    "KVOffloadPolicy",
    "KVOffloadRedisTier",
    "KVOffloadSettings",
    "KVOffloadSpec",
    "KVOffloadVLLMPolicy",
    "KVOffloadWorker",
    "parse_settings",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None and name.startswith("KVOffload") and name.endswith("Policy"):
        # kvoffload's policies as vLLM cache policies: KVOffload<Name>Policy, one per policy.
        module = "policies"
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
