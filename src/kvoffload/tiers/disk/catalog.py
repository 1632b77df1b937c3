"""The disk tier's in-memory index (which key is in which slot), kept in step with its log.

Every change is made here first and then recorded in ``index.log``
(``index.IndexLog``): a PUT once the slot's bytes are written, a DEL before
a slot is overwritten. Re-opening replays the log, drops entries of slots
that a truncated slab lost, keeps the newest slot of a key written twice
and compacts the log when it grew well past what it describes.

Invariants: ``by_slot`` and ``by_key`` hold the same entries; a refused log
write never changes them (only durability across a restart is lost,
counted in ``stats`` and reported by the store's alarm); compaction is an
optimisation, so a full filesystem only postpones it. Callers hold the
store's lock for every call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.tiers.alarm import FailingAlarm
from kvoffload.tiers.disk.index import DiskEntry, IndexLog, del_record, is_no_space, put_record

if TYPE_CHECKING:
    from kvoffload.tiers.disk.store import DiskStoreStats

# The store's logger: the disk tier's messages keep the one name they always had.
logger = logging.getLogger("kvoffload.tiers.disk.store")

INDEX_NAME = "index.log"


def write_alarm(directory: Path) -> FailingAlarm:
    """The disk tier's alarm: one warning when writes start failing, one when they work again.

    Callers hold the store's lock.
    """
    return FailingAlarm(
        logger,
        ("blocks", "records"),
        failing="disk tier {directory}: {why} ({err}); disk-tier writes are skipped and "
        "counted until they succeed again ({blocks} blocks, {records} index records so far)",
        recovered="disk tier {directory}: writes succeed again ({blocks} block writes and "
        "{records} index records failed meanwhile)",
        closed="disk tier {directory}: closed while writes were failing ({blocks} block writes "
        "and {records} index records failed since the first failure)",
        directory=directory,
    )


def why_failed(err: BaseException) -> str:
    return "the filesystem is full" if is_no_space(err) else "writes fail"


class DiskCatalog:
    """``by_slot`` / ``by_key`` over ``log`` for a store of ``capacity_blocks`` slots."""

    def __init__(
        self,
        directory: Path,
        log: IndexLog,
        capacity_blocks: int,
        stats: DiskStoreStats,
        alarm: FailingAlarm,
    ) -> None:
        self.directory = directory
        self.log = log
        self.capacity_blocks = capacity_blocks
        self.stats = stats
        self.alarm = alarm
        self.by_slot: dict[int, DiskEntry] = {}
        self.by_key: dict[bytes, DiskEntry] = {}
        self.next_seq = 1
        self._compact_at = 0

    def load(self, blocks_per_file: int, truncated_from: Mapping[int, int]) -> None:
        """Rebuild from the log; ``truncated_from``: slab file -> first slot it lost."""
        entries, bad = self.log.replay()
        dropped = 0
        for slot in list(entries):
            f, local = divmod(slot, blocks_per_file)
            if slot >= self.capacity_blocks or local >= truncated_from.get(f, 1 << 62):
                del entries[slot]
                dropped += 1
        by_key: dict[bytes, DiskEntry] = {}
        for e in sorted(entries.values(), key=lambda e: e.seq):
            old = by_key.get(e.key)
            if old is not None:
                # A key rewritten to another slot: the newest write wins.
                del entries[old.slot]
            by_key[e.key] = e
        self.by_slot = entries
        self.by_key = by_key
        self.next_seq = max((e.seq for e in entries.values()), default=0) + 1
        if bad or dropped:
            logger.warning(
                "disk tier %s: skipped %d damaged index records, dropped %d entries of "
                "truncated slabs",
                self.directory,
                bad,
                dropped,
            )
        if bad or dropped or self.log.num_records > 2 * len(entries) + 1024:
            # Compaction is an optimisation: on a full filesystem the log is kept as it is.
            self.compact(entries.values(), at_open=True)

    def append(self, records: list[bytes], healthy: bool = True) -> bool:
        """Append index records. False when refused (counted).

        ``healthy``: whether a success means writes work again (False when the
        caller's own block writes failed or are still to come).

        A refused DEL leaves an older PUT in the log for a slot about to be
        overwritten; after a restart that entry fails its checksum (the slot
        holds other bytes) and is dropped, so it is never served.
        """
        log = self.log
        if not records:
            return True
        if not log.append(records):
            self.stats.index_errors += len(records)
            assert log.last_error is not None
            self.alarm.failed(log.last_error, why=why_failed(log.last_error), records=len(records))
            return False
        if healthy:
            self.alarm.succeeded()
        threshold = 2 * len(self.by_slot) + 1024 + self.capacity_blocks
        if log.num_records > max(self._compact_at, threshold):
            self.compact(self.by_slot.values())
        return True

    def compact(self, entries: Iterable[DiskEntry], at_open: bool = False) -> None:
        """Rewrite the log as a snapshot; on failure keep the log and retry much later."""
        log = self.log
        if log.rewrite(sorted(entries, key=lambda e: e.seq)):
            self._compact_at = 0
            return
        self.stats.compaction_errors += 1
        # The log stays valid as it is; try again once it grew by a capacity's worth.
        self._compact_at = log.num_records + self.capacity_blocks + 1024
        logger.warning(
            "disk tier %s: could not compact %s (%s); keeping it as it is%s",
            self.directory,
            INDEX_NAME,
            log.last_error,
            " (opened read-mostly until there is room)" if at_open else "",
        )

    def vacate(self, keys: Iterable[bytes], slots: Iterable[int]) -> list[bytes]:
        """Forget what ``slots`` hold and where ``keys`` are, before a put overwrites the slots.

        Returns the DEL records of the slots left empty (not those of ``slots``
        themselves, which the put's PUT records replace).
        """
        records = []
        for k, s in zip(keys, slots):
            for old in (self.by_slot.pop(s, None), self.by_key.pop(k, None)):
                if old is not None:
                    self.by_slot.pop(old.slot, None)
                    self.by_key.pop(old.key, None)
                    if old.slot != s:
                        records.append(del_record(old.slot))
        return records

    def add(self, key: bytes, slot: int, checksum: int) -> bytes | None:
        """Record ``key`` at ``slot`` after its bytes were written; its PUT record, or None
        when a concurrent put claimed the slot or key meanwhile (that write wins)."""
        if slot in self.by_slot or key in self.by_key:
            return None
        e = DiskEntry(key, slot, checksum, self.next_seq)
        self.next_seq += 1
        self.by_slot[slot] = e
        self.by_key[key] = e
        return put_record(e)

    def forget(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop ``keys``; the DEL records of those that were known."""
        records = []
        for k in keys:
            e = self.by_key.pop(k, None)
            if e is not None:
                del self.by_slot[e.slot]
                records.append(del_record(e.slot))
        return records

    def drop_if_current(self, entry: DiskEntry) -> None:
        """Drop ``entry`` unless it was replaced meanwhile (and log the DEL)."""
        if self.by_slot.get(entry.slot) is entry:
            del self.by_slot[entry.slot]
            del self.by_key[entry.key]
            self.append([del_record(entry.slot)])

    def clear(self) -> None:
        """Forget every entry and empty the log in place (needs no free space)."""
        self.by_key.clear()
        self.by_slot.clear()
        self.log.truncate()
