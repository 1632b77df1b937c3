"""The negative control's connector: ``KVOffloadConnector`` whose host pool is overwritten
before every load, so every block loaded from the CPU tier carries wrong KV.

Used only by tests/e2e_vllm (``kv_connector_module_path="tests.e2e_vllm.corrupt_connector"``;
the engine runs with the repository root on ``PYTHONPATH``). Importing this module patches
``KVOffloadWorker.submit_load`` in the importing process, which for vLLM's multiprocess
executor is the worker process that builds the connector: the production worker has no
hook for this.
"""

from __future__ import annotations

from typing import Any

from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.worker.worker import KVOffloadWorker

#: The byte written over the whole host pool (0x3C3C3C3C is about 0.0115 as float32).
POISON = 0x3C

_submit_load = KVOffloadWorker.submit_load


def _poisoned_submit_load(self: KVOffloadWorker, job_id: int, *args: Any, **kwargs: Any) -> bool:
    # The pool's tensors are uint8 planes (``plane_layout``): every byte is overwritten.
    for tensor in self.host_pool.tensors:
        tensor.fill_(POISON)
    return _submit_load(self, job_id, *args, **kwargs)


KVOffloadWorker.submit_load = _poisoned_submit_load  # type: ignore[method-assign]


class CorruptingKVOffloadConnector(KVOffloadConnector):
    """``KVOffloadConnector`` with the poisoning patch above in force."""
