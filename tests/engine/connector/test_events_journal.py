"""``OffloadEventDescriber``'s payload journal follows the disk tier, and only it.

The journal keeps the self-describing payloads of the disk tier's blocks so a
restarted engine announces them with their tokens at once. A removal from
another tier (the CPU tier drops its copy, the disk keeps it) must leave the
journal entry alone; a removal from the disk deletes it.
"""

from __future__ import annotations

from pathlib import Path

from kvoffload.engine.connector.events import OffloadEventDescriber
from kvoffload.events import MEDIUM_CPU, MEDIUM_DISK, BlockStored
from kvoffload.events.journal import JOURNAL_NAME, PayloadJournal
from kvoffload.offload.base import OffloadingEvent, make_offload_key

HASH = b"\x07" * 32
TOKENS = [11, 12, 13, 14]
KEY = make_offload_key(HASH, 0)


def _describer(directory: Path) -> OffloadEventDescriber:
    d = OffloadEventDescriber(self_describing=True)
    d.keep_payloads_in(str(directory))
    return d


def _stored_on_cpu_and_disk(directory: Path) -> OffloadEventDescriber:
    d = _describer(directory)
    d.observe(
        BlockStored(
            block_hashes=[HASH],
            parent_block_hash=None,
            token_ids=TOKENS,
            block_size=len(TOKENS),
            lora_id=None,
            medium="GPU",
        )
    )
    out = d.translate(
        [OffloadingEvent([KEY], MEDIUM_CPU, False), OffloadingEvent([KEY], MEDIUM_DISK, False)]
    )
    assert [e.token_ids for e in out if isinstance(e, BlockStored)] == [TOKENS, TOKENS]
    return d


def _restart_announcement(directory: Path) -> BlockStored:
    """What a restarted engine's describer says of the disk's start-up announcement."""
    d = _describer(directory)
    (event,) = d.translate([OffloadingEvent([KEY], MEDIUM_DISK, False)])
    assert isinstance(event, BlockStored)
    assert d.journal is not None
    d.journal.close()
    return event


def test_a_cpu_removal_keeps_the_disk_blocks_payload_across_a_restart(tmp_path: Path) -> None:
    d = _stored_on_cpu_and_disk(tmp_path)
    d.translate([OffloadingEvent([KEY], MEDIUM_CPU, True)])
    assert d.journal is not None
    d.journal.close()
    event = _restart_announcement(tmp_path)
    assert event.token_ids == TOKENS
    assert event.block_size == len(TOKENS)


def test_a_disk_removal_deletes_the_journal_entry(tmp_path: Path) -> None:
    d = _stored_on_cpu_and_disk(tmp_path)
    d.translate([OffloadingEvent([KEY], MEDIUM_DISK, True)])
    assert d.journal is not None
    d.journal.close()
    journal = PayloadJournal(tmp_path / JOURNAL_NAME)
    try:
        assert KEY not in journal.entries
    finally:
        journal.close()
    # Announced again after a restart (the disk tier re-found it), it is a placeholder.
    event = _restart_announcement(tmp_path)
    assert event.block_size == 0 and not event.token_ids
