"""kvoffload's lines inside vLLM come out in vLLM's log format, with a level (issue 32).

Behind vLLM's OpenAI server, a Redis tier going away or coming back, a full
disk and dropped blocks were logged under ``kvoffload.*``, a name vLLM's
logging set-up does not handle: Python's last-resort handler printed the
bare message, and a user grepping vLLM's ``WARNING`` lines never saw them.
Here vLLM's own handler and formatter sit on the ``vllm`` logger (as vLLM's
logging config puts them, ``propagate=False``), and kvoffload's real code
paths log: the lines must come out through that handler, formatted by
vLLM, under ``vllm.kvoffload.*``.
"""

from tests.vllm_required import need_vllm

need_vllm()

import io  # noqa: E402
import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from vllm.logging_utils import NewLineFormatter  # noqa: E402

import kvoffload.integrations.vllm.tiers.base  # noqa: E402, F401  (installs the bridge)
from kvoffload.integrations.vllm import log_bridge  # noqa: E402
from kvoffload.tiers.redis.breaker import Breaker  # noqa: E402

#: vLLM's line format (``vllm.logger._FORMAT`` without its prefix and process name).
FORMAT = "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"


class _Names(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.names.append(record.name)


@pytest.fixture
def vllm_output() -> Iterator[tuple[io.StringIO, list[str]]]:
    """What vLLM's handler on the ``vllm`` logger writes, and the loggers it came from."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(NewLineFormatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
    handler.setLevel(logging.INFO)
    names = _Names()
    vllm_logger = logging.getLogger("vllm")
    saved = (vllm_logger.level, vllm_logger.propagate)
    vllm_logger.setLevel(logging.INFO)
    vllm_logger.propagate = False
    vllm_logger.addHandler(handler)
    vllm_logger.addHandler(names)
    log_bridge.install()  # as at import inside vLLM: kvoffload takes vLLM's level (INFO)
    try:
        yield stream, names.names
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.removeHandler(names)
        vllm_logger.setLevel(saved[0])
        vllm_logger.propagate = saved[1]
        log_bridge.install()


def test_a_redis_outage_and_its_end_are_vllm_warnings(
    vllm_output: tuple[io.StringIO, list[str]],
) -> None:
    stream, names = vllm_output
    breaker = Breaker("redis", "redis://kv.example:6379/0", 1.0, 30.0)
    breaker.mark_down(ConnectionError("connection refused"))
    breaker.mark_up()
    lines = stream.getvalue().splitlines()
    down = [line for line in lines if "is unreachable" in line]
    back = [line for line in lines if "is back after" in line]
    assert len(down) == 1 and down[0].startswith("WARNING "), lines
    assert len(back) == 1 and back[0].startswith("WARNING "), lines
    assert "[breaker.py:" in down[0]  # vLLM's file and line field, filled for our record
    assert names == ["vllm.kvoffload.tiers.redis.breaker"] * 2


def test_info_lines_pass_at_vllms_level(vllm_output: tuple[io.StringIO, list[str]]) -> None:
    """An unset ``kvoffload`` level takes vLLM's: INFO lines reach vLLM's handler too."""
    stream, names = vllm_output
    logging.getLogger("kvoffload.tiers.disk.store").info("disk tier: compacted its log")
    logging.getLogger("kvoffload.tiers.disk.store").debug("not shown at INFO")
    lines = stream.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["INFO"], lines
    assert names == ["vllm.kvoffload.tiers.disk.store"]


def test_installing_twice_adds_nothing(vllm_output: tuple[io.StringIO, list[str]]) -> None:
    stream, _ = vllm_output
    log_bridge.install()
    log_bridge.install()
    logging.getLogger("kvoffload.tiers.redis.store").warning("dropped 3 values")
    assert len(stream.getvalue().splitlines()) == 1


def test_vllms_tier_loader_installs_it() -> None:
    """vLLM's own ``TieringOffloadingSpec`` imports only the tier's module: the bridge is on."""
    code = (
        "import logging, kvoffload.integrations.vllm.tiers.disk\n"
        "from kvoffload.integrations.vllm.log_bridge import ToVLLMHandler\n"
        "hs = logging.getLogger('kvoffload').handlers\n"
        "print(sum(isinstance(h, ToVLLMHandler) for h in hs))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "1", out.stderr[-2000:]
