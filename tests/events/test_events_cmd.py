"""``kvoffload events`` against a live publisher: in-process and as a subprocess."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvoffload.cli import events_cmd
from kvoffload.events.subscriber import GapReport
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from tests.events.conftest import TOPIC, PublisherFactory

H = bytes(range(32))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    events_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def _stream(args: argparse.Namespace) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = events_cmd.stream_events(args, out, err)
    return rc, out.getvalue(), err.getvalue()


def _sample_events(i: int) -> list:
    return [
        BlockStored([H, bytes([i]) * 32], None, list(range(32)), 16, None, "GPU"),
        BlockRemoved([H], "CPU"),
        AllBlocksCleared(),
    ]


def test_json_from_seq_replays_buffered_batches(make_pub: PublisherFactory) -> None:
    pub = make_pub(data_parallel_rank=2)
    for i in range(4):
        pub.publish(_sample_events(i))
    assert pub.flush()
    args = _args(
        "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
        "--from-seq", "1", "--max-batches", "3", "--json", "--timeout", "10",
    )  # fmt: skip
    rc, out, err = _stream(args)
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["seq"] for line in lines] == [1, 2, 3]
    assert all(line["replayed"] for line in lines)
    assert lines[0]["data_parallel_rank"] == 2
    assert lines[0]["events"] == [
        {
            "type": "BlockStored",
            "block_hashes": [H.hex(), (bytes([1]) * 32).hex()],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [H.hex()], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_live_text_output(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    args = _args("--endpoint", pub.endpoint, "--topic", TOPIC, "--max-batches", "3")
    result: list[tuple[int, str, str]] = []
    runner = threading.Thread(target=lambda: result.append(_stream(args)))
    runner.start()
    # Keep publishing until the command has its three batches (it may join late).
    i = 0
    while runner.is_alive() and i < 500:
        pub.publish(_sample_events(i % 256))
        runner.join(0.02)
        i += 1
    runner.join(10)
    assert result, "the command did not finish"
    rc, out, _ = result[0]
    assert rc == 0
    heads = [line for line in out.splitlines() if line.startswith("seq=")]
    assert len(heads) == 3
    assert "events=3" in heads[0]
    assert f"  BlockStored medium=GPU blocks=2 [{H[:8].hex()}," in out
    assert "parent=- tokens=32 block_size=16" in out
    assert f"  BlockRemoved medium=CPU blocks=1 [{H[:8].hex()}]" in out
    assert "  AllBlocksCleared" in out


def test_lost_batches_are_reported_on_stderr(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=3)
    for i in range(10):
        pub.publish(_sample_events(i))
    assert pub.flush()
    args = _args(
        "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
        "--from-seq", "0", "--max-batches", "3", "--timeout", "10",
    )  # fmt: skip
    rc, out, err = _stream(args)
    assert rc == 0
    assert [line.split()[0] for line in out.splitlines() if line.startswith("seq=")] == [
        "seq=7",
        "seq=8",
        "seq=9",
    ]
    assert "lost (not in the replay buffer): 0..6" in err


def test_timeout_before_max_batches_is_exit_status_1(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    rc, out, _ = _stream(
        _args("--endpoint", pub.endpoint, "--max-batches", "1", "--timeout", "0.2")
    )
    assert rc == 1
    assert out == ""
    rc, _, _ = _stream(_args("--endpoint", pub.endpoint, "--timeout", "0.2"))
    assert rc == 0


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="--from-seq needs --replay-endpoint"):
        _stream(_args("--from-seq", "0"))
    with pytest.raises(ValueError, match="--max-batches"):
        _stream(_args("--max-batches", "0"))


def test_format_gap() -> None:
    assert events_cmd.format_gap(GapReport(5, 9, 5, ())) == "gap: seq 5..9 (5) missed, 5 replayed"
    assert events_cmd.format_gap(GapReport(5, 9, 2, ((5, 7),))).endswith(
        "2 replayed; lost (not in the replay buffer): 5..7"
    )


def test_subprocess_kvoffload_events(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    for i in range(2):
        pub.publish(_sample_events(i))
    assert pub.flush()
    src = Path(events_cmd.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvoffload.cli", "events",
            "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
            "--from-seq", "0", "--max-batches", "2", "--json", "--timeout", "20",
        ],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["seq"] for line in lines] == [0, 1]
    assert lines[1]["events"][0]["block_hashes"][1] == (bytes([1]) * 32).hex()
