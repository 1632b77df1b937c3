"""``PayloadJournal``: payloads survive a reopen; a torn tail or garbage ends the replay."""

from __future__ import annotations

from pathlib import Path

from kvoffload.events.journal import PayloadJournal

P1 = ([b"\x01" * 32], None, [1, 2, 3, 4], [None], 4, None, None)
P2 = ([b"\x02" * 32], b"\x01" * 32, [5, 6, 7, 8], [("tenant",)], 4, 7, "adapter")


def _reopen(path: Path) -> dict[bytes, tuple]:
    j = PayloadJournal(path)
    try:
        return j.entries
    finally:
        j.close()


def test_puts_and_deletes_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    j = PayloadJournal(path)
    j.put(b"k1", P1)
    j.put(b"k2", P2)
    j.put(b"k3", P1)
    j.delete(b"k3")
    j.flush()
    j.close()
    got = _reopen(path)
    assert set(got) == {b"k1", b"k2"}
    assert got[b"k2"][0] == [b"\x02" * 32] and got[b"k2"][3] == [["tenant"]]
    assert got[b"k2"][5:] == (7, "adapter")


def test_a_torn_tail_keeps_every_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    j = PayloadJournal(path)
    j.put(b"k1", P1)
    j.put(b"k2", P2)
    j.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # the last record cut short, as by a crash
    assert set(_reopen(path)) == {b"k1"}
    path.write_bytes(b"\xff\xff\xff\xff garbage")
    assert _reopen(path) == {}


def test_keep_only_compacts_to_what_the_tier_holds(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    j = PayloadJournal(path)
    for i in range(50):
        j.put(f"k{i}".encode(), P1)
    j.flush()
    before = path.stat().st_size
    j.keep_only({b"k1", b"k2"})
    j.put(b"k3", P2)
    j.close()
    assert path.stat().st_size < before / 5
    assert set(_reopen(path)) == {b"k1", b"k2", b"k3"}
