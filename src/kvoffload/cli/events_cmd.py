"""``kvoffload events``: print a KV event publisher's events live.

Connects a SUB socket to ``--endpoint`` (and a replay DEALER to
``--replay-endpoint``), prints each batch as it arrives, and on a jump in seq
fetches the missed batches from the replay socket; what the publisher no
longer has is reported on stderr as lost. Either wire profile ("vllm" or
"legacy") is read, from kvoffload's publisher or vLLM's. Undecodable batches,
malformed messages and publisher restarts are reported on stderr as they
happen and counted in a summary line at exit. ``--json`` prints one JSON object
per batch (JSON Lines; always valid JSON: byte hashes as hex, integer hashes as
numbers, a non-finite number as null).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, TextIO

from kvoffload.cli import argtypes
from kvoffload.events.subscriber import GapReport, KVEventSubscriber, ReceivedBatch, SubscriberStats
from kvoffload.events.types import KVCacheEvent

# recv() wakes at least this often, so --timeout is honoured promptly.
_POLL_S = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        type=argtypes.zmq_connect_endpoint,
        default="tcp://127.0.0.1:5557",
        help="the publisher's PUB endpoint (default: %(default)s)",
    )
    parser.add_argument(
        "--replay-endpoint",
        type=argtypes.zmq_connect_endpoint,
        default=None,
        help="the publisher's ROUTER replay endpoint; without it gaps are only reported",
    )
    parser.add_argument(
        "--topic", default="", help="topic prefix to subscribe to (default: every topic)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per batch")
    parser.add_argument(
        "--max-batches",
        type=argtypes.positive_int(1 << 62),
        default=None,
        metavar="N",
        help="exit after N batches",
    )
    parser.add_argument(
        "--timeout",
        type=argtypes.finite_float(0.0, 1e7),
        default=None,
        metavar="S",
        help="exit after S seconds; with --max-batches, exit status 1 if fewer arrived",
    )
    parser.add_argument(
        "--from-seq",
        type=argtypes.any_int(2**64 - 1, 0),
        default=None,
        metavar="SEQ",
        help="first replay everything buffered from SEQ on (needs --replay-endpoint)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return stream_events(args, sys.stdout, sys.stderr)
    except BrokenPipeError:
        # `kvoffload events | head` closing the pipe is a normal way to stop.
        return 0


def stream_events(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The command's body, writing to ``out`` / ``err``; returns the exit status."""
    max_batches: int | None = args.max_batches
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"--max-batches must be >= 1, got {max_batches}")
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.from_seq is not None and args.replay_endpoint is None:
        raise ValueError("--from-seq needs --replay-endpoint")
    if args.from_seq is not None and args.from_seq < 0:
        raise ValueError(f"--from-seq must be >= 0, got {args.from_seq}")

    def on_gap(report: GapReport) -> None:
        err.write(format_gap(report) + "\n")
        err.flush()

    def on_notice(text: str) -> None:
        err.write(f"kvoffload events: {text}\n")
        err.flush()

    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    printed = 0
    with KVEventSubscriber(
        args.endpoint,
        args.replay_endpoint,
        args.topic,
        start_seq=args.from_seq,
        on_gap=on_gap,
        on_notice=on_notice,
    ) as sub:
        replay = f", replay {sub.replay_endpoint}" if sub.replay_endpoint else ""
        topic = f"topic {args.topic!r}" if args.topic else "all topics"
        err.write(f"kvoffload events: listening on {sub.endpoint} ({topic}){replay}\n")
        err.flush()
        while max_batches is None or printed < max_batches:
            wait = _POLL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    break
            for received in sub.recv(wait):
                out.write((format_json(received) if args.json else format_text(received)) + "\n")
                printed += 1
                if max_batches is not None and printed >= max_batches:
                    break
            out.flush()
        summary = format_summary(sub.stats)
        if summary:
            err.write(summary + "\n")
            err.flush()
    if max_batches is not None and printed < max_batches:
        return 1
    return 0


# -- formatting ------------------------------------------------------------------


def _wire_value(value: Any) -> Any:
    """A wire value as strict JSON: bytes as hex, tuples as lists, NaN/inf as null."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list | tuple):
        return [_wire_value(v) for v in value]
    if isinstance(value, dict):
        return {str(_wire_value(k)): _wire_value(v) for k, v in value.items()}
    return value


def _tag(event: KVCacheEvent) -> str:
    tag = type(event).__struct_config__.tag
    return str(tag) if tag is not None else type(event).__name__


def _shown_fields(event: KVCacheEvent) -> list[str]:
    """The fields as the vLLM profile puts them on the wire: those without a
    default (and ``lora_id``, ``medium``, ``lora_name``) always, the rest when set."""
    fields = event.__struct_fields__
    always = len(fields) - len(event.__struct_defaults__)
    keep = {"lora_id", "medium", "lora_name"}
    return [
        name
        for i, name in enumerate(fields)
        if i < always or name in keep or getattr(event, name) is not None
    ]


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """An event as JSON-able fields in wire order, its tag under ``type``."""
    out: dict[str, Any] = {"type": _tag(event)}
    for name in _shown_fields(event):
        out[name] = _wire_value(getattr(event, name))
    return out


def format_json(received: ReceivedBatch) -> str:
    batch = received.batch
    record: dict[str, Any] = {
        "seq": received.seq,
        "ts": _wire_value(batch.ts),
        "data_parallel_rank": batch.data_parallel_rank,
        "replayed": received.replayed,
        "format": received.profile,
        "epoch": received.epoch,
        "events": [event_to_dict(e) for e in batch.events],
    }
    # allow_nan=False: anything non-finite left would be a bug, not bad JSON.
    return json.dumps(record, allow_nan=False)


def _short_hash(value: Any) -> str:
    if isinstance(value, bytes):
        return value[:8].hex()
    if isinstance(value, int) and 0 <= value < 1 << 64:
        return f"{value:016x}"
    return str(value)


def _hashes(values: list[Any]) -> str:
    shown = ",".join(_short_hash(v) for v in values[:4])
    more = f",...+{len(values) - 4}" if len(values) > 4 else ""
    return f"[{shown}{more}]"


def format_event(event: KVCacheEvent) -> str:
    parts = [_tag(event)]
    # The tier first: it is what a reader scans for.
    medium = getattr(event, "medium", None)
    if medium is not None:
        parts.append(f"medium={medium}")
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name == "medium":
            continue
        if name == "block_hashes":
            parts.append(f"blocks={len(value)} {_hashes(value)}")
        elif name == "parent_block_hash":
            parts.append(f"parent={'-' if value is None else _short_hash(value)}")
        elif name == "token_ids":
            parts.append(f"tokens={len(value)}")
        elif value is not None:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def format_ts(ts: float) -> str:
    """``HH:MM:SS.mmm`` local time, or the raw value when it is no usable time."""
    try:
        whole = math.floor(ts)
        stamp = time.strftime("%H:%M:%S", time.localtime(whole))
        return f"{stamp}.{min(999, int((ts - whole) * 1000)):03d}"
    except (OverflowError, OSError, ValueError):
        return repr(ts)


def format_text(received: ReceivedBatch) -> str:
    batch = received.batch
    head = f"seq={received.seq} ts={format_ts(batch.ts)} events={len(batch.events)}"
    if batch.data_parallel_rank is not None:
        head += f" dp_rank={batch.data_parallel_rank}"
    if received.replayed:
        head += " (replayed)"
    return "\n".join([head, *("  " + format_event(e) for e in batch.events)])


def format_gap(report: GapReport) -> str:
    missed = report.last - report.first + 1
    text = f"gap: seq {report.first}..{report.last} ({missed}) missed, {report.recovered} replayed"
    if report.lost:
        ranges = ", ".join(f"{a}..{b}" for a, b in report.lost)
        text += f"; lost (not in the replay buffer): {ranges}"
    return text


def format_summary(stats: SubscriberStats) -> str:
    """One stderr line at exit when anything went wrong; "" otherwise."""
    counts = {
        "undecodable": stats.undecodable,
        "malformed": stats.malformed - stats.undecodable,
        "lost": stats.lost_batches,
        "resyncs": stats.resyncs,
        "replay timeouts": stats.replay_timeouts,
    }
    shown = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    if not shown:
        return ""
    return f"kvoffload events: {stats.received} batches received; {shown}"
