"""kvoffload inside vLLM 0.33: a KV-connector plug-in (optional extra ``kvoffload[vllm]``).

Two public names, for ``--kv-transfer-config`` (see docs/vllm.md):

- ``KVOffloadSpec``: an ``OffloadingSpec`` for vLLM's stock
  ``OffloadingConnector`` (``"spec_name": "KVOffloadSpec"``,
  ``"spec_module_path": "kvoffload.integrations.vllm"``);
- ``KVOffloadConnector``: the connector with that spec preselected and vLLM's
  load-failure recovery wired (``"kv_connector": "KVOffloadConnector"``,
  ``"kv_connector_module_path": "kvoffload.integrations.vllm"``).

Importing this package imports vLLM; the core ``kvoffload`` package never does.
"""

from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.manager import KVOffloadJobSpec, KVOffloadManager
from kvoffload.integrations.vllm.settings import (
    KVOffloadConfigError,
    KVOffloadSettings,
    parse_settings,
)
from kvoffload.integrations.vllm.spec import KVOffloadSpec
from kvoffload.integrations.vllm.worker import KVOffloadWorker

__all__ = [
    "KVOffloadConfigError",
    "KVOffloadConnector",
    "KVOffloadJobSpec",
    "KVOffloadManager",
    "KVOffloadSettings",
    "KVOffloadSpec",
    "KVOffloadWorker",
    "parse_settings",
]
