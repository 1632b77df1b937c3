"""What an instance's tiers hold, tracked from its KV-event stream by counting copies.

For an engine the test cannot look into (a real vLLM engine in another
venv), the holdings come from the same stream Dynamo reads, but counted as a
consumer that needs no exactness from the stream would: per (tier, hash) the
number of stores minus removals, held while above zero. A per-copy stream
(vLLM's block pool announces each copy of a block) and an exact per-hash one
give the same holdings here; Dynamo keeps one entry per hash, so where the two
differ, the stream was not exact.

Blocks are found from a prompt's tokens through the chain the stores
describe ((parent hash, block tokens) -> hash), so no hash function is
assumed: the engine's own hashes are used as they are.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvoffload.bench.routing.indexer import TierOverlap
from kvoffload.events.subscriber import KVEventSubscriber
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from tests.router.truth import staged_overlap

#: (medium, locality) on the wire -> the tier Dynamo's answer names.
TIERS = {
    ("GPU", None): "gpu",
    ("CPU", None): "cpu",
    ("STORAGE", "LOCAL"): "disk",
    ("DISK", None): "disk",
}


def tier_of(event: BlockStored | BlockRemoved) -> str | None:
    medium = event.medium or "GPU"  # vLLM's block pool may leave the GPU's medium unset
    return TIERS.get((medium, event.locality), TIERS.get((medium, None)))


class StreamHoldings:
    """Subscribes to ``endpoint`` (replaying from seq 0) and counts copies per tier."""

    def __init__(self, endpoint: str, replay: str | None, topic: str = "") -> None:
        # A stream starts at a restart-safe seq far above 0. With the default
        # max_gap a subscriber that joins after its first batches takes the
        # first one it sees as the start and never asks for the earlier ones
        # (seen: 1 run in 3 of `kvoffload run`); any gap is replayed here, and
        # the replay's answer says where the stream starts.
        self.sub = KVEventSubscriber(endpoint, replay, topic, start_seq=0, max_gap=1 << 62)
        self.copies: Counter[tuple[str, object]] = Counter()
        self.chain: dict[tuple[object, tuple[int, ...]], object] = {}
        self.stores: Counter[str] = Counter()
        self.over_removed: Counter[str] = Counter()  # a removal of a copy never stored
        self.batches = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for item in self.sub.recv(timeout_s=0.1):
                with self._lock:
                    self.batches += 1
                    for event in item.batch.events:
                        self._apply(event)

    def _apply(self, event: object) -> None:
        if isinstance(event, AllBlocksCleared):
            self.copies = Counter({k: n for k, n in self.copies.items() if k[0] != "gpu"})
            return
        if not isinstance(event, (BlockStored, BlockRemoved)):
            return
        tier = tier_of(event)
        if tier is None:
            return
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if self.copies[(tier, h)] > 0:
                    self.copies[(tier, h)] -= 1
                else:
                    self.over_removed[tier] += 1
            return
        self.stores[tier] += len(event.block_hashes)
        n = len(event.block_hashes)
        per = len(event.token_ids) // n if n and event.token_ids else 0
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            if per:
                self.chain[(parent, tuple(event.token_ids[i * per : (i + 1) * per]))] = h
            self.copies[(tier, h)] += 1
            parent = h

    def settle(self, quiet_s: float = 2.0, limit_s: float = 60.0) -> None:
        """Until no batch arrived for ``quiet_s`` (longer than the subscriber's
        replay timeout, so batches held behind a replay are handed out)."""
        deadline = time.monotonic() + limit_s
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            with self._lock:
                n = self.batches
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.1)

    def overlap(self, token_ids: Sequence[int], block_size: int) -> TierOverlap:
        """Dynamo's staged answer for ``token_ids`` over the copy-counted holdings."""
        flags: dict[str, list[bool]] = {"gpu": [], "cpu": [], "disk": []}
        parent: object = None
        with self._lock:
            for start in range(0, len(token_ids) - block_size + 1, block_size):
                h = self.chain.get((parent, tuple(token_ids[start : start + block_size])))
                if h is None:
                    break
                for tier in flags:
                    flags[tier].append(self.copies[(tier, h)] > 0)
                parent = h
        return staged_overlap(flags, block_size)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sub.close()
