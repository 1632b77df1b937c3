"""A test policy that records every hint and protects queued requests' keys.

Registered under ``RECORDER`` so that managers built by name (``CPUOffloadingManager(n,
RECORDER)``, the engine, the vLLM plug-in) use it. Eviction is LRU over the
unprotected keys first; protected keys go only when nothing else is left (the
contract: ``evict(n)`` returns ``n`` keys whenever ``n <= num_evictable()``).
The scan in ``evict`` is fine for a test policy; real ones stay O(1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvoffload.offload import OffloadKey
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.lru import LRUPolicy
from kvoffload.offload.policies.registry import POLICIES, register_policy

RECORDER = "test_hint_recorder"

#: Every recorder ever built, newest last (a manager's reset builds a new one).
INSTANCES: list[HintRecorder] = []


class HintRecorder(LRUPolicy):
    name = RECORDER

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.calls: list[tuple] = []
        self.queued: dict[str, list[OffloadKey]] = {}
        self.protected: Counter[OffloadKey] = Counter()
        self.continued: list[OffloadKey] = []
        INSTANCES.append(self)

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        self.calls.append(("queued", request_id, list(keys)))
        self._release(request_id)
        self.queued[request_id] = list(keys)
        self.protected.update(keys)

    def hint_dequeued(self, request_id: str) -> None:
        self.calls.append(("dequeued", request_id))
        self._release(request_id)

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        self.calls.append(("continues", list(keys)))
        self.continued.extend(keys)

    def _release(self, request_id: str) -> None:
        old = self.queued.pop(request_id, None)
        if old:
            self.protected.subtract(old)
            self.protected += Counter()  # drop counts that reached zero

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        free = [k for k in self._order if k not in self.protected]
        chosen = free[:n]
        if len(chosen) < n:
            chosen += [k for k in self._order if k in self.protected][: n - len(chosen)]
        for k in chosen:
            del self._order[k]
        return chosen


if RECORDER not in POLICIES:
    register_policy(HintRecorder)


def latest() -> HintRecorder:
    return INSTANCES[-1]


def queue_aware_policies() -> list[str]:
    """The recording policy and every registered policy that acts on queue hints."""
    names = [RECORDER]
    for name, cls in sorted(POLICIES.items()):
        if name != RECORDER and cls.hint_queued is not CachePolicy.hint_queued:
            names.append(name)
    return names
