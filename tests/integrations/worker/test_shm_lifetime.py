"""The CPU tier's ``/dev/shm`` region never outlives its engine (issue 32).

Behind vLLM's OpenAI server with a disk or Redis tier, 3 of 6 servers
stopped with Ctrl-C left ``/dev/shm/vllm_offload_<engine id>.mmap`` (the size
of ``cpu_bytes``): vLLM force-kills its engine core, and only the file's
creator unlinked it, at a clean shutdown. Here: the name goes once every
process mapped it (so a SIGKILL afterwards leaves nothing), a start-up that
fails part-way leaves nothing on a clean exit, a dead engine's file is
removed at the next start-up with one line, and a live engine's is not.
Processes are real (``multiprocessing`` spawn), and so are the signals.
"""

from tests.vllm_required import need_vllm

need_vllm()

import contextlib  # noqa: E402
import glob  # noqa: E402
import logging  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvoffload.integrations.vllm.worker import shm_lifetime  # noqa: E402
from kvoffload.integrations.vllm.worker.shm_lifetime import (  # noqa: E402
    SharedRegionError,
    open_shared_region,
    region_path,
    sweep_stale_regions,
)
from tests.integrations.shm_child import CHUNKS, PAGE, ROW, hold, open_region  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def lines() -> Iterator[list[str]]:
    """kvoffload's shm lines (vLLM's ``vllm`` logger does not propagate to pytest's capture)."""
    handler = _Lines()
    log = logging.getLogger("vllm.kvoffload.shm")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


@pytest.fixture
def engine_id() -> Iterator[str]:
    eid = f"kvo-test-{uuid.uuid4().hex[:12]}"
    yield eid
    for suffix in ("", ".1"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(region_path(eid) + suffix)


# -- in one process ------------------------------------------------------------------


def test_the_name_goes_once_every_process_mapped_it(engine_id: str, lines: list[str]) -> None:
    path = region_path(engine_id)
    w0 = open_region(engine_id, 0)
    w1 = open_region(engine_id, 1)
    assert os.path.exists(path), "the scheduler has not mapped it yet"
    sched = open_region(engine_id, None)
    assert not os.path.exists(path)
    assert any("all 3 processes mapped" in line and line.startswith("INFO") for line in lines)
    # One memory for all three: what rank 1 writes in its shard the scheduler's row holds.
    view = w1.create_next_worker_view(PAGE)
    view[2].copy_(torch.arange(PAGE, dtype=torch.int64).to(torch.int8))
    row = sched.base_tensor.view(CHUNKS, ROW)[2]
    assert torch.equal(row[PAGE:ROW], view[2])
    for region in (w0, w1, sched):
        region.cleanup()
    assert not os.path.exists(path)


def test_a_start_that_stops_part_way_leaves_nothing(engine_id: str) -> None:
    path = region_path(engine_id)
    w0 = open_region(engine_id, 0)
    assert os.path.exists(path)
    w0.cleanup()  # the engine failed before rank 1 and the scheduler mapped it
    assert not os.path.exists(path)


def test_a_dead_engines_file_at_this_path_is_removed_with_one_line(
    engine_id: str, lines: list[str]
) -> None:
    path = region_path(engine_id)
    Path(path).write_bytes(b"\0" * (CHUNKS * ROW))  # no lock holder: its engine is gone
    region = open_region(engine_id, None, world=0)  # the scheduler alone completes the set
    assert not os.path.exists(path)
    stale = [line for line in lines if "removed" in line and "dead engine" in line]
    assert len(stale) == 1 and stale[0].startswith("WARNING"), lines
    region.cleanup()


def test_a_live_engine_with_another_layout_is_refused_in_one_line(engine_id: str) -> None:
    w0 = open_region(engine_id, 0)
    with pytest.raises(SharedRegionError, match="another layout") as info:
        open_shared_region(engine_id, CHUNKS + 1, 1, ROW, PAGE, world_size=2)
    assert "\n" not in str(info.value)
    w0.cleanup()


def test_vllms_own_regions_are_never_swept(engine_id: str) -> None:
    """vLLM's own CPU tier takes no lock: an unlocked file without kvoffload's header stays."""
    path = region_path(engine_id)
    Path(path).write_bytes(b"\0" * (CHUNKS * ROW))
    sweep_stale_regions()
    assert os.path.exists(path)


def test_without_o_tmpfile_a_scratch_name_is_used_and_never_left(
    engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm_lifetime, "_USE_TMPFILE", False)
    w0 = open_region(engine_id, 0)
    assert glob.glob(region_path(engine_id) + ".*") == []
    w1, sched = open_region(engine_id, 1), open_region(engine_id, None)
    assert not os.path.exists(region_path(engine_id))
    for region in (w0, w1, sched):
        region.cleanup()


def test_a_scratch_file_of_a_killed_process_is_swept(engine_id: str) -> None:
    scratch = f"{region_path(engine_id)}.4242.0badf00d{shm_lifetime.MAKING}"
    Path(scratch).write_bytes(b"\0" * PAGE)  # killed before writing its header, unlocked
    assert sweep_stale_regions() >= 1
    assert not os.path.exists(scratch)


# -- across processes, with SIGKILL --------------------------------------------------


def _start(engine_id: str, ranks: list[int | None], world: int) -> tuple[Any, bool]:
    ctx = multiprocessing.get_context("spawn")  # see shm_child: a forked child can hang
    ready = ctx.Queue()
    proc = ctx.Process(target=hold, args=(engine_id, ranks, world, ready), daemon=True)
    proc.start()
    named = ready.get(timeout=120)
    return proc, named


def _kill(proc: Any, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(proc.pid, sig)
    proc.join(timeout=60)
    assert proc.exitcode is not None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_no_signal_to_a_started_engine_leaves_anything(engine_id: str, sig: signal.Signals) -> None:
    """Worker and scheduler mapped (vLLM's uniproc executor): killed, and no file is left."""
    proc, named = _start(engine_id, [0, None], world=1)
    assert named is False, "the name must be gone once both mapped"
    _kill(proc, sig)
    assert not os.path.exists(region_path(engine_id))


def test_sigkill_during_start_up_is_swept_by_the_next_engine(
    engine_id: str, lines: list[str]
) -> None:
    """A worker killed before the scheduler mapped: its file stays while it lives, then goes."""
    path = region_path(engine_id)
    proc, named = _start(engine_id, [0], world=1)
    assert named is True
    assert sweep_stale_regions() == 0, "a live engine's region must not be removed"
    assert os.path.exists(path)
    _kill(proc)
    assert os.path.exists(path)  # nothing ran in the killed process
    # The next engine's first region sweeps it (once per process: reset for the test).
    other = f"{engine_id}-next"
    shm_lifetime._swept = False
    try:
        region = open_region(other, None, world=0)
        region.cleanup()
    finally:
        if os.path.exists(region_path(other)):  # pragma: no cover - a failure above
            os.unlink(region_path(other))
    assert not os.path.exists(path)
    stale = [line for line in lines if path in line and "removed" in line]
    assert len(stale) == 1 and stale[0].startswith("WARNING"), lines


def test_a_joiner_of_a_live_region_shares_its_memory(engine_id: str) -> None:
    """A peer process created it; this process joins (never creates a second file)."""
    proc, named = _start(engine_id, [0], world=1)
    assert named
    try:
        sched = open_region(engine_id, None, world=1)
        assert not os.path.exists(region_path(engine_id))
        sched.cleanup()
    finally:
        _kill(proc)
    assert not os.path.exists(region_path(engine_id))
