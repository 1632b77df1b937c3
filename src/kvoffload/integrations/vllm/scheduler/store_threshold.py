"""vLLM's ``store_threshold``: store a block only once it has been offered that many times."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey


class StoreThreshold:
    """Offer counts of the ``max_tracker_size`` keys offered most recently.

    A key is worth storing on its ``threshold``-th offer (a threshold below 2
    stores every offer, as vLLM's does). A key pushed out of the tracker starts
    again from zero, so memory stays bounded whatever the key stream.
    """

    __slots__ = ("_offers", "max_tracker_size", "threshold")

    def __init__(self, threshold: int = 0, max_tracker_size: int = 64_000) -> None:
        self.threshold = threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OrderedDict[OffloadKey, int] = OrderedDict()

    @property
    def active(self) -> bool:
        return self.threshold >= 2

    def offered(self, key: OffloadKey) -> bool:
        """Count one offer of ``key``; True once it has reached the threshold."""
        n = self._offers.pop(key, 0) + 1
        self._offers[key] = n
        if len(self._offers) > self.max_tracker_size:
            self._offers.popitem(last=False)
        return n >= self.threshold

    def clear(self) -> None:
        self._offers.clear()
