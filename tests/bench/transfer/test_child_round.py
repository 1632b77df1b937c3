"""``bench transfer``'s child: each timed job starts after the same pause.

Started right after the bulk copies, a job shared the cores with their
OpenMP team while it spun before sleeping; the store came first after them
and paid it, the load did not (``child.SETTLE_S``).
"""

from __future__ import annotations

import pytest

from kvoffload.bench.transfer import child


def test_every_job_of_a_round_starts_after_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = {
        "dtype": "float16",
        "layers": 2,
        "kv_heads": 2,
        "head_size": 64,
        "block_tokens": 16,
        "layout": "layer_first",
        "pool": 9,
        "n": 8,
        "seed": 0,
        "pattern": "chains",
        "threads": 2,
    }
    rig = child.Rig(setup)
    events: list[str] = []
    job = rig._job
    monkeypatch.setattr(child, "settle", lambda: events.append("settle"))
    monkeypatch.setattr(rig, "_job", lambda store: (events.append("job"), job(store)))
    try:
        times = rig.round()
    finally:
        rig.close()
    assert events == ["settle", "job", "settle", "job"]
    assert len(times) == 4 and all(t > 0 for t in times)
    assert child.SETTLE_S > 0
