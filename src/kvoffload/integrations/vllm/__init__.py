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
(``kvoffload.integrations.vllm.worker.worker``) needs only vLLM's
``vllm.v1.kv_offload.base``: the GPU check runs it on a machine without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports
from kvoffload.integrations.vllm._exports import PolicyNames

if TYPE_CHECKING:
    from kvoffload.integrations.vllm.connector import KVOffloadConnector
    from kvoffload.integrations.vllm.scheduler.manager import KVOffloadJobSpec, KVOffloadManager
    from kvoffload.integrations.vllm.scheduler.policies import KVOffloadPolicy, KVOffloadVLLMPolicy
    from kvoffload.integrations.vllm.settings import (
        KVOffloadConfigError,
        KVOffloadSettings,
        parse_settings,
    )
    from kvoffload.integrations.vllm.spec import KVOffloadSpec
    from kvoffload.integrations.vllm.tiers.disk import KVOffloadDiskTier
    from kvoffload.integrations.vllm.tiers.mooncake import KVOffloadMooncakeTier
    from kvoffload.integrations.vllm.tiers.redis import KVOffloadRedisTier
    from kvoffload.integrations.vllm.worker.worker import KVOffloadWorker

_WHERE: dict[str, str] = {
    "KVOffloadConnector": f"{__name__}.connector",
    "KVOffloadJobSpec": f"{__name__}.scheduler.manager",
    "KVOffloadManager": f"{__name__}.scheduler.manager",
    "KVOffloadConfigError": f"{__name__}.settings",
    "KVOffloadSettings": f"{__name__}.settings",
    "parse_settings": f"{__name__}.settings",
    "KVOffloadSpec": f"{__name__}.spec",
    "KVOffloadDiskTier": f"{__name__}.tiers.disk",
    "KVOffloadRedisTier": f"{__name__}.tiers.redis",
    "KVOffloadMooncakeTier": f"{__name__}.tiers.mooncake",
    "KVOffloadWorker": f"{__name__}.worker.worker",
    "KVOffloadPolicy": f"{__name__}.scheduler.policies",
    "KVOffloadVLLMPolicy": f"{__name__}.scheduler.policies",
    "POLICY_CLASSES": f"{__name__}.scheduler.policies",
}

__all__ = [
    "KVOffloadConfigError",
    "KVOffloadConnector",
    "KVOffloadDiskTier",
    "KVOffloadJobSpec",
    "KVOffloadManager",
    "KVOffloadMooncakeTier",
    "KVOffloadPolicy",
    "KVOffloadRedisTier",
    "KVOffloadSettings",
    "KVOffloadSpec",
    "KVOffloadVLLMPolicy",
    "KVOffloadWorker",
    "parse_settings",
]


# kvoffload's policies as vLLM cache policies: KVOffload<Name>Policy, one per policy.
__getattr__ = lazy_exports(__name__, PolicyNames(_WHERE, f"{__name__}.scheduler.policies"))
