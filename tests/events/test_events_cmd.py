"""``kvoffload events`` against a live publisher: in-process and as a subprocess."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvoffload.cli import events_cmd
from kvoffload.events.subscriber import GapReport
from kvoffload.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    vllm_block_hash,
)
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
    assert pub.flush(120.0)
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
    assert lines[0]["format"] == "vllm"
    assert lines[0]["events"] == [
        {
            "type": "BlockStored",
            "block_hashes": [vllm_block_hash(H), vllm_block_hash(bytes([1]) * 32)],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        },
        {
            "type": "BlockRemoved",
            "block_hashes": [vllm_block_hash(H)],
            "medium": "CPU",
            "group_idx": 0,
        },
        {"type": "AllBlocksCleared"},
    ]


def test_json_legacy_profile_shows_byte_hashes_as_hex(make_pub: PublisherFactory) -> None:
    pub = make_pub(profile="legacy")
    pub.publish(_sample_events(1))
    assert pub.flush(120.0)
    args = _args(
        "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
        "--from-seq", "0", "--max-batches", "1", "--json", "--timeout", "10",
    )  # fmt: skip
    rc, out, err = _stream(args)
    assert rc == 0, err
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert line["format"] == "legacy"
    assert line["data_parallel_rank"] is None
    assert line["events"][0]["block_hashes"] == [H.hex(), (bytes([1]) * 32).hex()]
    assert line["events"][1] == {"type": "BlockRemoved", "block_hashes": [H.hex()], "medium": "CPU"}


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
    short = f"{vllm_block_hash(H):016x}"
    assert f"  BlockStored medium=GPU blocks=2 [{short}," in out
    assert "parent=- tokens=32 block_size=16" in out
    assert f"  BlockRemoved medium=CPU blocks=1 [{short}]" in out
    assert "  AllBlocksCleared" in out


def test_lost_batches_are_reported_on_stderr(make_pub: PublisherFactory) -> None:
    pub = make_pub(buffer_steps=3)
    for i in range(10):
        pub.publish(_sample_events(i))
    assert pub.flush(120.0)
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


def _namespace(**overrides: object) -> argparse.Namespace:
    values = {
        "endpoint": "tcp://127.0.0.1:1",
        "replay_endpoint": None,
        "topic": "",
        "json": False,
        "max_batches": None,
        "timeout": None,
        "from_seq": None,
    }
    return argparse.Namespace(**{**values, **overrides})


def test_bad_arguments_are_value_errors() -> None:
    # stream_events checks its arguments itself too, for callers without the parser.
    with pytest.raises(ValueError, match="--from-seq needs --replay-endpoint"):
        _stream(_namespace(from_seq=0))
    with pytest.raises(ValueError, match="--max-batches"):
        _stream(_namespace(max_batches=0))
    for bad in (math.nan, math.inf, -1.0, 0.0):
        with pytest.raises(ValueError, match="--timeout must be a finite number"):
            _stream(_namespace(timeout=bad))
    with pytest.raises(ValueError, match="--from-seq must be >= 0"):
        _stream(_namespace(from_seq=-3, replay_endpoint="tcp://127.0.0.1:1"))


@pytest.mark.parametrize(
    "argv",
    [
        ("--timeout", "nan"),
        ("--timeout", "inf"),
        ("--timeout", "-1"),
        ("--max-batches", "0"),
        ("--from-seq", "-1"),
        ("--replay-endpoint", "garbage"),
    ],
)
def test_bad_flags_are_parser_errors(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)


def test_format_gap() -> None:
    assert events_cmd.format_gap(GapReport(5, 9, 5, ())) == "gap: seq 5..9 (5) missed, 5 replayed"
    assert events_cmd.format_gap(GapReport(5, 9, 2, ((5, 7),))).endswith(
        "2 replayed; lost (not in the replay buffer): 5..7"
    )


def test_subprocess_kvoffload_events(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    for i in range(2):
        pub.publish(_sample_events(i))
    assert pub.flush(120.0)
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
    assert lines[1]["events"][0]["block_hashes"][1] == vllm_block_hash(bytes([1]) * 32)


def _run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    src = Path(events_cmd.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "events", *argv],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def test_timeout_nan_is_one_line_and_exits() -> None:
    proc = _run_cli("--timeout", "nan")
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--timeout" in proc.stderr


def test_garbage_replay_endpoint_exits_with_one_line() -> None:
    # Used to hang for ever: the DEALER that failed to connect leaked and
    # blocked ctx.term(). The subprocess timeout is only a hang guard.
    proc = _run_cli("--replay-endpoint", "garbage", "--timeout", "1")
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "garbage" in proc.stderr


def test_unreachable_replay_endpoint_still_honours_timeout(make_pub: PublisherFactory) -> None:
    # A syntactically fine endpoint with nobody behind it: replays time out,
    # back off, and the command ends on its own --timeout.
    pub = make_pub()
    args = _args(
        "--endpoint", pub.endpoint, "--replay-endpoint", "tcp://127.0.0.1:1",
        "--from-seq", "0", "--timeout", "0.5",
    )  # fmt: skip
    rc, out, err = _stream(args)
    assert rc == 0
    assert out == ""
    assert err.count("\n") == 1  # just the "listening" line: the replay is still open


def test_nan_and_huge_timestamps_print_safely(make_pub: PublisherFactory) -> None:
    pub = make_pub()
    stamps = [math.nan, 1e300, -math.inf, 12.5]
    for ts in stamps:
        pub.publish(KVEventBatch(ts=ts, events=[AllBlocksCleared()]))
    assert pub.flush(120.0)
    common = (
        "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
        "--from-seq", "0", "--max-batches", "4", "--timeout", "10",
    )  # fmt: skip
    rc, out, err = _stream(_args(*common))
    assert rc == 0, err
    heads = [line for line in out.splitlines() if line.startswith("seq=")]
    assert [h.split()[1] for h in heads[:3]] == ["ts=nan", "ts=1e+300", "ts=-inf"]
    rc, out, err = _stream(_args(*common, "--json"))
    assert rc == 0, err
    # json.loads would accept NaN; the strict check is that no bare NaN/Infinity appears.
    assert "NaN" not in out and "Infinity" not in out
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["ts"] for line in lines] == [None, 1e300, None, 12.5]


def test_undecodable_batches_are_reported_on_stderr(make_pub: PublisherFactory) -> None:
    import zmq

    from tests.events.conftest import LOOPBACK_ANY

    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)
    raw.bind(LOOPBACK_ANY)
    endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT)
    result: list[tuple[int, str, str]] = []
    args = _args("--endpoint", endpoint, "--max-batches", "1", "--timeout", "20")
    runner = threading.Thread(target=lambda: result.append(_stream(args)))
    runner.start()
    try:
        assert raw.poll(10_000)
        raw.recv()  # the subscription
        raw.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
        raw.send_multipart([b"", (1).to_bytes(8, "big"), b"\x93\x01\x02\x03"])
        from kvoffload.events.types import encode_batch

        good = encode_batch(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
        raw.send_multipart([b"", (2).to_bytes(8, "big"), good])
        runner.join(20)
    finally:
        raw.close(linger=0)
        ctx.term()
    assert result, "the command did not finish"
    rc, out, err = result[0]
    assert rc == 0
    assert out.startswith("seq=2 ")
    assert "seq 0: undecodable batch" in err
    assert "seq 1: undecodable batch" in err
    assert "2 undecodable" in err and "2 lost" in err
