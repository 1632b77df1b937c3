"""``kvoffload bench events``: KV event throughput and live delivery on loopback.

For each wire profile, one publisher sends ``--batches`` batches of
``--events`` events to a plain pyzmq SUB consumer on another thread. It prints
the engine-side publish rate, the socket thread's send rate, how many batches
arrived live within ``--deadline`` seconds (the rest are fetched by replay, so
nothing is lost: the figure is about timeliness, which depends on the
machine's load), the replay time for what was missed, and the subscriber-side
decode rate. The "legacy" profile, measured in the same run, is the baseline
for the ratios.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import zmq

from kvoffload.cli import argtypes
from kvoffload.events.publisher import END_SEQ, ZmqEventPublisher
from kvoffload.events.types import (
    MEDIUM_GPU,
    PROFILE_LEGACY,
    PROFILE_VLLM,
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
)

_LOOPBACK = "tcp://127.0.0.1:*"
_TOPIC = b"kv-events"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batches", type=argtypes.positive_int(1_000_000), default=10_000, help="batches"
    )
    parser.add_argument(
        "--events", type=argtypes.positive_int(10_000), default=100, help="events per batch"
    )
    parser.add_argument(
        "--deadline",
        type=argtypes.finite_float(0.0, 3600.0),
        default=10.0,
        help="seconds the consumer waits for live batches before replaying the rest",
    )
    parser.add_argument(
        "--profiles",
        type=argtypes.name_list,
        default=list(PROFILES),
        help=f"comma-separated wire profiles (default: {','.join(PROFILES)})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _events(n: int, i: int) -> list[Any]:
    parent = b"\x01" * 32
    out: list[Any] = [
        BlockStored([j.to_bytes(32, "big")], parent, list(range(16)), 16, None, MEDIUM_GPU)
        for j in range(n - 1)
    ]
    out.append(BlockRemoved([i.to_bytes(8, "big")], MEDIUM_GPU))
    return out


def _receive(
    sub: zmq.Socket, first: int, last: int, out: list[tuple[int, bytes]], deadline: float
) -> None:
    while time.monotonic() < deadline:
        if not sub.poll(20):
            continue
        while True:
            try:
                _, seq_bytes, payload = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= first:
                out.append((seq, payload))
            if seq >= last:
                return


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> dict[int, bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: dict[int, bytes] = {}
    try:
        while dealer.poll(60_000):
            frames = dealer.recv_multipart()
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                break
            got[int.from_bytes(seq_bytes, "big")] = payload
    finally:
        dealer.close(linger=0)
    return got


def bench_profile(profile: str, batches: int, events: int, deadline_s: float) -> dict[str, Any]:
    """One profile's figures (see the module docstring)."""
    size = batches + 100
    pub = ZmqEventPublisher(
        _LOOPBACK, _LOOPBACK, _TOPIC.decode(), buffer_steps=size, hwm=size, profile=profile
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, size)
    sub.setsockopt(zmq.SUBSCRIBE, _TOPIC)
    sub.connect(pub.endpoint)
    try:
        for _ in range(1000):  # beat the slow joiner
            pub.publish([AllBlocksCleared()])
            if sub.poll(20):
                break
        pub.flush()
        while sub.poll(50):
            sub.recv_multipart()
        first = pub.next_seq
        last = first + batches - 1
        payloads = [_events(events, i) for i in range(batches)]
        received: list[tuple[int, bytes]] = []
        t0 = time.monotonic()
        receiver = threading.Thread(
            target=_receive, args=(sub, first, last, received, t0 + deadline_s)
        )
        receiver.start()
        for ev in payloads:
            pub.publish(ev)
        publish_s = time.monotonic() - t0
        pub.flush(3600.0)
        sent_s = time.monotonic() - t0
        receiver.join()
        received_s = time.monotonic() - t0
        live = {s for s, _ in received}
        missing = sorted(set(range(first, last + 1)) - live)
        t1 = time.monotonic()
        replayed = _replay(ctx, pub.replay_endpoint or "", missing[0]) if missing else {}
        replay_s = time.monotonic() - t1
        recovered = len(set(missing) & set(replayed))
        t2 = time.monotonic()
        for _, payload in received:
            decode_batch(payload)
        decode_s = time.monotonic() - t2
        payload_bytes = sum(len(p) for _, p in received)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.shutdown()
    n_events = batches * events
    return {
        "profile": profile,
        "batches": batches,
        "events_per_batch": events,
        "publish_batches_per_s": batches / publish_s if publish_s > 0 else None,
        "publish_events_per_s": n_events / publish_s if publish_s > 0 else None,
        "send_batches_per_s": batches / sent_s if sent_s > 0 else None,
        "live_batches": len(live),
        "live_fraction": len(live) / batches,
        "live_by_s": received_s,
        "replayed_batches": recovered,
        "lost_batches": len(missing) - recovered,
        "replay_s": replay_s,
        "decode_batches_per_s": len(received) / decode_s if decode_s > 0 and received else None,
        "mean_payload_bytes": payload_bytes / len(received) if received else None,
    }


def run(args: argparse.Namespace) -> int:
    profiles = list(args.profiles)
    for p in profiles:
        if p not in PROFILES:
            raise ValueError(f"unknown profile {p!r}; choose from {', '.join(PROFILES)}")
    from kvoffload.bench.console import progress_bar

    results: dict[str, dict[str, Any]] = {}
    with progress_bar("events", len(profiles), show=not args.json) as advance:
        for p in profiles:
            advance(0, f"profile {p}")
            results[p] = bench_profile(p, args.batches, args.events, args.deadline)
            advance()
    ratios: dict[str, float] = {}
    if PROFILE_VLLM in results and PROFILE_LEGACY in results:
        v, legacy = results[PROFILE_VLLM], results[PROFILE_LEGACY]
        for key in ("publish_batches_per_s", "send_batches_per_s", "decode_batches_per_s"):
            if v[key] and legacy[key]:
                ratios[f"{key}_vllm_vs_legacy"] = v[key] / legacy[key]
        if v["mean_payload_bytes"] and legacy["mean_payload_bytes"]:
            ratios["payload_bytes_vllm_vs_legacy"] = (
                v["mean_payload_bytes"] / legacy["mean_payload_bytes"]
            )
    report = {"profiles": results, "ratios": ratios}
    if args.json:
        print(json.dumps(report))
        return 0
    from kvoffload.bench.console import console, table

    cols = ("profile", "publish ev/s", "send b/s", "live", "by s", "replayed", "lost")
    rows = [
        (
            r["profile"],
            f"{r['publish_events_per_s'] or 0:,.0f}",
            f"{r['send_batches_per_s'] or 0:,.0f}",
            f"{r['live_fraction']:.1%}",
            f"{r['live_by_s']:.2f}",
            str(r["replayed_batches"]),
            str(r["lost_batches"]),
            f"{r['decode_batches_per_s'] or 0:,.0f}",
            f"{r['mean_payload_bytes'] or 0:,.0f}",
        )
        for r in results.values()
    ]
    out = console()
    title = f"KV events: {args.batches:,} batches x {args.events} events, loopback"
    out.print(table(title, (*cols, "decode b/s", "bytes/batch"), rows))
    for name, value in ratios.items():
        out.print(f"{name}: {value:.2f}x")
    out.print("(wall-clock figures: noisy on a shared machine)")
    return 0
