"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues, quick demotion of one-hit keys.

New keys enter the small queue S (about 10% of the capacity). When S is over
its share, its oldest key either moves to the main queue M (it was used
again while in S) or is evicted and remembered in the ghost queue G (keys
only). A stored key that G remembers goes straight to M. M is evicted like
CLOCK: its oldest key is reinserted with its use count lowered while that is
non-zero, otherwise evicted. Use counts saturate at 3, so every reinsertion is
paid by an earlier access: O(1) amortised.

Pinned keys keep their queue membership and counts but leave the queues;
they come back at their queue's tail when unpinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.offload.base import OffloadKey
from kvoffload.offload.policies.base import CachePolicy

SMALL, MAIN = 0, 1
MAX_FREQ = 3


class S3FIFOPolicy(CachePolicy):
    name = "s3fifo"
    small_fraction = 0.1

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small: OrderedDict[OffloadKey, None] = OrderedDict()  # unpinned, oldest first
        self.main: OrderedDict[OffloadKey, None] = OrderedDict()
        self.ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.freq: dict[OffloadKey, int] = {}  # resident keys
        self._queue_of: dict[OffloadKey, int] = {}
        self._pinned: set[OffloadKey] = set()
        self.n_small = 0  # pinned included
        self.small_target = max(1, int(capacity * self.small_fraction))
        self.ghost_capacity = max(1, capacity - self.small_target)

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def num_evictable(self) -> int:
        return len(self.small) + len(self.main)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            self.freq[key] = 0
            if key in self.ghost:
                del self.ghost[key]
                self.main[key] = None
                self._queue_of[key] = MAIN
            else:
                self.small[key] = None
                self._queue_of[key] = SMALL
                self.n_small += 1

    def access(self, keys: Sequence[OffloadKey]) -> None:
        freq = self.freq
        for key in keys:
            f = freq[key]
            if f < MAX_FREQ:
                freq[key] = f + 1

    def pin(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            (self.small if self._queue_of[key] == SMALL else self.main).pop(key)
            self._pinned.add(key)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        for key in self.chain_order(keys):
            self._pinned.remove(key)
            (self.small if self._queue_of[key] == SMALL else self.main)[key] = None

    def _forget(self, key: OffloadKey) -> None:
        del self.freq[key]
        del self._queue_of[key]

    def _evict_one(self) -> OffloadKey:
        small, main, freq = self.small, self.main, self.freq
        while True:
            if small and (self.n_small > self.small_target or not main):
                key, _ = small.popitem(last=False)
                self.n_small -= 1
                if freq[key] > 0:
                    freq[key] = 0
                    main[key] = None
                    self._queue_of[key] = MAIN
                    continue
                self._forget(key)
                self.ghost[key] = None
                if len(self.ghost) > self.ghost_capacity:
                    self.ghost.popitem(last=False)
                return key
            key, _ = main.popitem(last=False)
            f = freq[key]
            if f > 0:
                freq[key] = f - 1
                main[key] = None
                continue
            self._forget(key)
            return key

    def evict(self, n: int, incoming: Sequence[OffloadKey]) -> list[OffloadKey]:
        return [self._evict_one() for _ in range(n)]
