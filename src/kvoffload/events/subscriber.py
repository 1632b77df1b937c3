"""A KV event subscriber: SUB for the live stream, DEALER for replay.

It speaks the vLLM-compatible protocol described in
:mod:`kvoffload.events.publisher`, and works against any publisher that does.

Invariants:

* :meth:`KVEventSubscriber.recv` hands out batches in strictly increasing seq
  order, each seq at most once (live duplicates of replayed batches are
  skipped).
* Once the first batch was handed out (or from ``start_seq`` when given), every
  seq is accounted for: handed out, or reported lost in :attr:`lost_ranges`
  because the publisher's replay buffer no longer (or never) had it, or its
  payload did not decode.
* A gap is filled before the batch after it is handed out: on a jump in seq the
  subscriber asks the replay socket for everything from the first missing seq,
  and uses what it gets, including batches newer than the one that revealed the
  gap.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from kvoffload.events.publisher import END_SEQ, seq_from_bytes, seq_to_bytes
from kvoffload.events.types import KVEventBatch, decode_batch

DEFAULT_RCVHWM = 100_000
# Live messages handled per recv() call at most, so one call returns promptly
# under a flood.
_RECV_CHUNK = 1024


@dataclass(frozen=True)
class ReceivedBatch:
    seq: int
    batch: KVEventBatch
    replayed: bool = False


@dataclass(frozen=True)
class GapReport:
    """A jump in seq: ``first..last`` (inclusive) were missing from the stream."""

    first: int
    last: int
    recovered: int
    lost: tuple[tuple[int, int], ...]


@dataclass
class SubscriberStats:
    received: int = 0
    replayed: int = 0
    duplicates: int = 0
    gaps: int = 0
    lost_batches: int = 0
    malformed: int = 0
    replay_timeouts: int = 0


# Raw (seq, payload, replayed) entries still to decode, in seq order.
_Pending = list[tuple[int, bytes, bool]]


def connectable(endpoint: str) -> str:
    """``tcp://*:5557`` (a bind address) -> ``tcp://127.0.0.1:5557``."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0)(:)", r"tcp://127.0.0.1\2", endpoint)


class KVEventSubscriber:
    """Receives KV event batches, detecting seq gaps and replaying what it missed.

    ``topic`` is a ZMQ prefix filter ("" takes every topic). ``start_seq``: hand
    out everything from this seq on, as far as the publisher's replay buffer
    reaches (None: start with whatever arrives first). ``replay_timeout_s``
    is how long to wait for each replay message before giving up on the rest;
    ``on_gap`` is called once per gap, after the fill attempt.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = None,
        rcvhwm: int = DEFAULT_RCVHWM,
        replay_timeout_s: float = 1.0,
        on_gap: Callable[[GapReport], None] | None = None,
    ) -> None:
        if start_seq is not None and start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        self.endpoint = connectable(endpoint)
        self.replay_endpoint = connectable(replay_endpoint) if replay_endpoint else None
        self.topic = topic
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._on_gap = on_gap
        self.stats = SubscriberStats()
        self.lost_ranges: list[tuple[int, int]] = []
        # The next seq to hand out; None until known.
        self._expected: int | None = start_seq
        self._initial_replay = start_seq is not None and self.replay_endpoint is not None

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._dealer: zmq.Socket | None = None
        try:
            self._sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._dealer = self._new_dealer()
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot connect to {endpoint!r} / {replay_endpoint!r}: {exc}") from exc
        self._closed = False

    @property
    def next_seq(self) -> int | None:
        """The seq expected next; None before anything arrived (without start_seq)."""
        return self._expected

    # -- receiving --------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> list[ReceivedBatch]:
        """Wait up to ``timeout_s`` (None: forever) for batches; [] on timeout.

        Returns every batch available now, live and replayed, in seq order.
        """
        pending: _Pending = []
        if self._initial_replay:
            self._initial_replay = False
            start = self._expected
            assert start is not None
            lost_before = len(self.lost_ranges)
            self._take_replay(start, None, pending)
            if pending and pending[0][0] > start:
                self.stats.gaps += 1
                self._report(start, pending[0][0] - 1, 0, lost_before)
            if pending:
                return self._decode(pending)
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            wait_ms = None
            if deadline is not None:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(wait_ms):
                return []
            for _ in range(_RECV_CHUNK):
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_live(frames, pending)
            if pending:
                batches = self._decode(pending)
                if batches:
                    return batches
                pending.clear()  # all undecodable (already counted and marked lost)
            # Only duplicates or malformed messages: keep waiting until the deadline.

    def _on_live(self, frames: list[bytes], pending: _Pending) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        seq = seq_from_bytes(frames[1])
        payload = frames[2]
        expected = self._expected
        if expected is not None and seq < expected:
            self.stats.duplicates += 1
            return
        if expected is not None and seq > expected:
            self._fill_gap(expected, seq, payload, pending)
            return
        pending.append((seq, payload, False))
        self._expected = seq + 1

    def _fill_gap(self, first: int, seq: int, payload: bytes, pending: _Pending) -> None:
        self.stats.gaps += 1
        before = len(pending)
        lost_before = len(self.lost_ranges)
        self._take_replay(first, (seq, payload), pending)
        recovered = sum(1 for s, _, r in pending[before:] if r and s < seq)
        self._report(first, seq - 1, recovered, lost_before)

    def _report(self, first: int, last: int, recovered: int, lost_before: int) -> None:
        if self._on_gap is not None:
            lost = tuple(self.lost_ranges[lost_before:])
            self._on_gap(GapReport(first, last, recovered, lost))

    def _take_replay(self, first: int, live: tuple[int, bytes] | None, pending: _Pending) -> None:
        """Append replayed batches from ``first`` on (and ``live``) in seq order.

        Records as lost every seq from ``first`` up to the newest one handed
        out that neither the replay nor ``live`` supplied.
        """
        got = {s: p for s, p in self._request_replay(first) if s >= first}
        if live is not None:
            got.setdefault(live[0], live[1])
        cursor = first
        for s in sorted(got):
            if s > cursor:
                self._lose(cursor, s - 1)
            is_live = live is not None and s == live[0]
            pending.append((s, got[s], not is_live))
            cursor = s + 1
        if got:
            self._expected = cursor

    def _lose(self, first: int, last: int) -> None:
        self.lost_ranges.append((first, last))
        self.stats.lost_batches += last - first + 1

    def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self._dealer
        if dealer is None:
            return []
        # The empty delimiter makes the request look like REQ's, which every
        # vLLM-compatible publisher accepts; replies then carry it too.
        dealer.send_multipart((b"", seq_to_bytes(start)))
        out: list[tuple[int, bytes]] = []
        while True:
            if not dealer.poll(self._replay_timeout_ms):
                # Replies to this request may still come; a fresh socket makes
                # sure they cannot be mistaken for the next request's.
                self.stats.replay_timeouts += 1
                dealer.close(linger=0)
                self._dealer = self._new_dealer()
                return out
            frames = dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                self.stats.malformed += 1
                continue
            if frames[0] == END_SEQ:
                return out
            out.append((seq_from_bytes(frames[0]), frames[1]))

    def _new_dealer(self) -> zmq.Socket:
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(self.replay_endpoint)
        return dealer

    def _decode(self, pending: _Pending) -> list[ReceivedBatch]:
        out: list[ReceivedBatch] = []
        for seq, payload, replayed in pending:
            try:
                batch = decode_batch(payload)
            except msgspec.DecodeError:
                # Its seq was seen, so account for it where callers look.
                self.stats.malformed += 1
                self._lose(seq, seq)
                continue
            out.append(ReceivedBatch(seq, batch, replayed))
            self.stats.received += 1
            if replayed:
                self.stats.replayed += 1
        return out

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
