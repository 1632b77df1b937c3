"""vLLM's ``store_threshold``: store a block only once it has been offered that many times.

The counting is kvoffload's one implementation of n-th-sighting admission
(``kvoffload.offload.policies.admission.Sightings``); this adds vLLM's
meaning of the threshold (below 2: every offer is stored).
"""

from __future__ import annotations

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.admission import Sightings


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
        self._offers = Sightings(max_tracker_size)

    @property
    def active(self) -> bool:
        return self.threshold >= 2

    def offered(self, key: OffloadKey) -> bool:
        """Count one offer of ``key``; True once it has reached the threshold."""
        return self._offers.sight(key) >= self.threshold

    def clear(self) -> None:
        self._offers.clear()
