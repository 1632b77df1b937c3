"""A process holding kvoffload's shared regions until a signal ends it (``test_shm_lifetime``).

The test starts it with multiprocessing's ``spawn``: a child forked from the
test process inherits the locks other threads of that process held at the
fork, and Ctrl-C's exit path in the child (traceback, finalizers) could wait
on one forever. It also restores Python's SIGINT handler, which an ignored
SIGINT in the test process would otherwise keep off.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from kvoffload.integrations.vllm.worker.shm_lifetime import open_shared_region, region_path

CHUNKS = 4
PAGE = 4096
ROW = 2 * PAGE  # two ranks' shards of one page each


def open_region(engine_id: str, rank: int | None, world: int = 2) -> Any:
    return open_shared_region(engine_id, CHUNKS, rank, ROW, PAGE, world_size=world)


def hold(engine_id: str, ranks: list[int | None], world: int, ready: Any) -> None:
    """Map the region as ``ranks``, say whether its name is still there, wait for a signal."""
    # As a freshly started engine: an ignored SIGINT is inherited across fork and exec
    # (code run earlier in the test process may ignore it), and Ctrl-C must end this one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    regions = [open_region(engine_id, rank, world) for rank in ranks]
    ready.put(os.path.exists(region_path(engine_id)))
    signal.pause()
    del regions
