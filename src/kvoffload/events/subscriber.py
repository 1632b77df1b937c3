"""A KV event subscriber: SUB for the live stream, DEALER for replay.

It speaks the protocol described in :mod:`kvoffload.events.publisher`, in
either wire profile, and works against any publisher that does: kvoffload's
and vLLM 0.33's own ``ZmqEventPublisher``. The replay socket, its open
request and its backoff are :mod:`kvoffload.events.replay_client`'s; this
module decides what to ask for and what to make of the answer.

Invariants:

* Within one *epoch* (the stream of one publisher incarnation),
  :meth:`KVEventSubscriber.recv` hands out batches in strictly increasing seq
  order, each seq at most once (live duplicates of replayed batches are
  skipped).
* Once the first batch of an epoch was handed out (or from ``start_seq`` when
  given), every seq of it is accounted for: handed out, or reported lost in
  :attr:`lost_ranges` because the publisher's replay buffer no longer (or
  never) had it, or its payload did not decode. Undecodable batches and
  malformed messages are also counted in :attr:`stats` and reported through
  ``on_notice``: none is dropped in silence.
* A live seq that goes back (and is not a copy of a batch replay already gave)
  means the publisher restarted; a jump forward by more than ``max_gap`` is
  not a believable gap (e.g. seq 2**64 - 2). Either starts a new epoch at that
  seq, with a notice, instead of waiting for a seq that will never come.
* A gap is filled before the batch after it is handed out: on a jump in seq
  the subscriber asks the replay socket for everything from the first missing
  seq and holds later live batches until the answer ends, or until no reply
  came for ``replay_timeout_s``; then it hands out what it got, including
  batches newer than the one that revealed the gap as far as they follow it
  without a hole (a seq missing there may still arrive live). Replay never makes
  ``recv`` overrun its caller's deadline: the request stays open across calls.
* After a replay timed out, replays back off (``replay_backoff_s``, doubling
  up to ``replay_backoff_max_s``); a gap met while backing off is recorded lost at
  once rather than waited for. A replay that answers resets the backoff.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from kvoffload.events.publisher import seq_from_bytes
from kvoffload.events.replay_client import ReplayClient, ReplayRequest
from kvoffload.events.types import KVEventBatch, decode_batch_profile

DEFAULT_RCVHWM = 100_000
#: A forward jump in seq beyond this is a resync, not a gap to replay.
DEFAULT_MAX_GAP = 1 << 32
DEFAULT_REPLAY_TIMEOUT_S = 1.0
DEFAULT_REPLAY_BACKOFF_S = 1.0
DEFAULT_REPLAY_BACKOFF_MAX_S = 30.0
# Live messages handled per pump at most, so one recv() returns promptly
# under a flood.
_RECV_CHUNK = 1024
# Malformed or undecodable message notices passed on one by one before they are
# only counted (a hostile peer can send them at any rate).
_NOTICE_LIMIT = 20


@dataclass(frozen=True)
class ReceivedBatch:
    seq: int
    batch: KVEventBatch
    replayed: bool = False
    #: The publisher incarnation: 0, then +1 at each resync.
    epoch: int = 0
    #: The wire profile the payload was in ("vllm" or "legacy").
    profile: str = ""


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
    undecodable: int = 0
    replay_timeouts: int = 0
    replays_skipped: int = 0
    resyncs: int = 0


# Raw entries still to decode, in order: (seq, payload, replayed, epoch).
_Pending = list[tuple[int, bytes, bool, int]]


def connectable(endpoint: str) -> str:
    """``tcp://*:5557`` (a bind address) -> ``tcp://127.0.0.1:5557``."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0)(:)", r"tcp://127.0.0.1\2", endpoint)


class KVEventSubscriber:
    """Receives KV event batches, detecting seq gaps and replaying what it missed.

    ``topic`` is a ZMQ prefix filter ("" takes every topic). ``start_seq``: hand
    out everything from this seq on, as far as the publisher's replay buffer
    reaches (None: start with whatever arrives first). ``replay_timeout_s``
    is how long a replay may go without a reply before the rest is given up;
    after that, replays pause for ``replay_backoff_s``, doubling at each
    further timeout up to ``replay_backoff_max_s``;
    ``on_gap`` is called once per gap, after the fill attempt; ``on_notice``
    gets one line per resync, replay timeout and undecodable or malformed
    message.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = None,
        rcvhwm: int = DEFAULT_RCVHWM,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        replay_backoff_s: float = DEFAULT_REPLAY_BACKOFF_S,
        replay_backoff_max_s: float = DEFAULT_REPLAY_BACKOFF_MAX_S,
        max_gap: int = DEFAULT_MAX_GAP,
        on_gap: Callable[[GapReport], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        if start_seq is not None and start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        for name, value in (
            ("replay_timeout_s", replay_timeout_s),
            ("replay_backoff_s", replay_backoff_s),
            ("replay_backoff_max_s", replay_backoff_max_s),
        ):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if max_gap < 1:
            raise ValueError(f"max_gap must be >= 1, got {max_gap}")
        self._closed = True  # until the sockets exist
        self.endpoint = connectable(endpoint)
        self.replay_endpoint = connectable(replay_endpoint) if replay_endpoint else None
        self.topic = topic
        self._max_gap = max_gap
        self._on_gap = on_gap
        self._on_notice = on_notice
        self.stats = SubscriberStats()
        self.lost_ranges: list[tuple[int, int]] = []
        self.epoch = 0
        # The next seq to hand out; None until known.
        self._expected: int | None = start_seq
        # The newest live seq handed out in this epoch.
        self._last_live: int | None = None
        self._initial_replay = start_seq is not None and self.replay_endpoint is not None
        # Replayed seqs newer than the newest live one: seq -> hash(payload),
        # so that their live copies are recognised as duplicates.
        self._replayed: dict[int, int] = {}
        self._held: deque[tuple[int, bytes]] = deque()
        self._pending: _Pending = []
        self._notices = 0

        self._ctx = zmq.Context()
        self._replayer: ReplayClient | None = None
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replayer = ReplayClient(
                    self._ctx,
                    self.replay_endpoint,
                    timeout_s=replay_timeout_s,
                    backoff_s=replay_backoff_s,
                    backoff_max_s=replay_backoff_max_s,
                    stats=self.stats,
                    notice=self._notice,
                )
        except zmq.ZMQError as exc:
            # destroy() closes every socket of the context with linger 0, so
            # a half-made subscriber can never make term() wait.
            self._ctx.destroy(linger=0)
            raise OSError(f"cannot connect to {endpoint!r} / {replay_endpoint!r}: {exc}") from exc
        self._closed = False

    @property
    def next_seq(self) -> int | None:
        """The seq expected next; None before anything arrived (without start_seq)."""
        return self._expected

    @property
    def _replay(self) -> ReplayRequest | None:
        """The open replay request, if any."""
        return self._replayer.request if self._replayer is not None else None

    @property
    def _can_replay(self) -> bool:
        return self._replayer is not None and self._replayer.connected

    # -- receiving --------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> list[ReceivedBatch]:
        """Wait up to ``timeout_s`` (None: forever) for batches; [] on timeout.

        Returns every batch available now, live and replayed, in seq order.
        Never waits past ``timeout_s``, not even for an open replay.
        """
        if timeout_s is not None and math.isnan(timeout_s):
            raise ValueError("timeout_s must not be NaN")
        deadline = None
        if timeout_s is not None and timeout_s != math.inf:
            deadline = time.monotonic() + max(0.0, timeout_s)
        if self._initial_replay:
            self._initial_replay = False
            assert self._expected is not None
            self._start_replay(self._expected, None)
        while True:
            self._pump()
            if self._pending:
                out = self._decode()
                if out:
                    return out
                # All undecodable (counted, reported, marked lost): keep waiting.
            now = time.monotonic()
            wait_until = deadline
            if self._replay is not None:
                wait_until = (
                    self._replay.deadline
                    if wait_until is None
                    else min(wait_until, self._replay.deadline)
                )
            if deadline is not None and now >= deadline:
                return []
            wait_ms = None if wait_until is None else max(0, math.ceil((wait_until - now) * 1000))
            self._wait(wait_ms)

    def _wait(self, wait_ms: int | None) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        dealer = self._replayer.poll_socket() if self._replayer is not None else None
        if dealer is not None:
            poller.register(dealer, zmq.POLLIN)
        poller.poll(wait_ms)

    def _pump(self) -> None:
        """Take what is readable now: replay replies first, then live messages."""
        replayer = self._replayer
        if replayer is not None and replayer.request is not None and replayer.read():
            self._finish_replay(timed_out=False)
        if replayer is not None and replayer.expired:
            self._finish_replay(timed_out=True)
        for _ in range(_RECV_CHUNK):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats.malformed += 1
                self._notice(f"malformed live message ({len(frames)} frames) ignored", flood=True)
                continue
            self._on_live(seq_from_bytes(frames[1]), frames[2])

    # -- live stream ------------------------------------------------------------

    def _on_live(self, seq: int, payload: bytes) -> None:
        if self._replay is not None:
            self._held.append((seq, payload))
            return
        expected = self._expected
        if expected is None or seq == expected:
            self._accept(seq, payload)
        elif seq > expected:
            if seq - expected > self._max_gap:
                self._resync(expected, seq, "jumped")
                if self._can_replay:
                    # A restarted publisher starts at a restart-safe seq far
                    # ahead; its first batches (missed while SUB was joining)
                    # are in its replay buffer. One try, whatever the backoff:
                    # a resync is rare.
                    self._start_replay(expected, (seq, payload), resync=True)
                    return
                self._accept(seq, payload)
            else:
                self._gap(expected, seq, payload)
        elif (self._last_live is not None and seq <= self._last_live) or (
            self._replayed.get(seq, hash(payload)) != hash(payload)
        ):
            # Live seqs only grow within an epoch, and a replayed seq's live
            # copy carries the same bytes: this is another publisher's stream.
            self._resync(expected, seq, "went back")
            self._accept(seq, payload)
        else:
            # A live copy of a seq replay already handed out (or recorded
            # lost), or one from before start_seq.
            self.stats.duplicates += 1
            # Still a live seq: the stream got this far, so a later step back
            # to it or below is a restart.
            self._saw_live(seq)

    def _accept(self, seq: int, payload: bytes) -> None:
        self._pending.append((seq, payload, False, self.epoch))
        self._expected = seq + 1
        self._saw_live(seq)

    def _saw_live(self, seq: int) -> None:
        self._last_live = seq
        # No live copy of a replayed seq at or below this one can come now.
        while self._replayed:
            oldest = next(iter(self._replayed))
            if oldest > seq:
                break
            del self._replayed[oldest]

    def _resync(self, expected: int, seq: int, how: str) -> None:
        self.stats.resyncs += 1
        self.epoch += 1
        self._replayed.clear()
        self._last_live = None
        self._notice(
            f"publisher seq {how} from {expected} to {seq} (publisher restarted, or a bad "
            f"seq): resynchronising at {seq}"
        )

    def _gap(self, first: int, seq: int, payload: bytes) -> None:
        self.stats.gaps += 1
        replayer = self._replayer
        if replayer is not None and replayer.connected and not replayer.backing_off:
            self._start_replay(first, (seq, payload))
            return
        if replayer is not None and replayer.connected:
            self.stats.replays_skipped += 1
        lost_before = len(self.lost_ranges)
        self._lose(first, seq - 1)
        self._accept(seq, payload)
        self._report(first, seq - 1, 0, lost_before)

    def _report(self, first: int, last: int, recovered: int, lost_before: int) -> None:
        if self._on_gap is not None:
            lost = tuple(self.lost_ranges[lost_before:])
            self._on_gap(GapReport(first, last, recovered, lost))

    def _lose(self, first: int, last: int) -> None:
        self.lost_ranges.append((first, last))
        self.stats.lost_batches += last - first + 1

    # -- replay -----------------------------------------------------------------

    def _start_replay(
        self, first: int, live: tuple[int, bytes] | None, *, resync: bool = False
    ) -> None:
        assert self._replayer is not None
        if not self._replayer.ask(first, live, resync=resync):
            self._finish_replay(timed_out=True)

    def _finish_replay(self, *, timed_out: bool) -> None:
        """Hand out what the replay brought (and the live batch), record the rest lost."""
        assert self._replayer is not None
        replay = self._replayer.close_request(timed_out=timed_out)
        first = replay.first
        live_seq = replay.live[0] if replay.live is not None else None
        got = {s: p for s, p in replay.got if s >= first}
        if replay.live is not None:
            got.setdefault(replay.live[0], replay.live[1])
            # Past the live batch, only a run without holes is used: a seq
            # missing there may still be on its way live (the buffer had
            # already dropped it), so it must not be declared lost.
            end = replay.live[0] + 1
            while end in got:
                end += 1
            got = {s: p for s, p in got.items() if s < end}
        if replay.resync:
            got = {s: p for s, p in got.items() if s - first > self._max_gap}
        if got and min(got) - first > self._max_gap:
            # Not a believable gap (as live): the stream starts there, e.g. an
            # engine's restart-safe first seq asked for "from seq 0".
            first = min(got)
        lost_before = len(self.lost_ranges)
        cursor = first
        for s in sorted(got):
            if s > cursor:
                self._lose(cursor, s - 1)
            replayed = s != live_seq
            self._pending.append((s, got[s], replayed, self.epoch))
            if replayed and (live_seq is None or s > live_seq):
                self._replayed[s] = hash(got[s])
            cursor = s + 1
        if got:
            self._expected = cursor
        if live_seq is not None:
            self._saw_live(live_seq)
        if live_seq is not None and first < live_seq:
            recovered = sum(1 for s in got if first <= s < live_seq)
            self._report(first, live_seq - 1, recovered, lost_before)
        elif got and min(got) > first:
            self.stats.gaps += 1
            self._report(first, min(got) - 1, 0, lost_before)
        # Live batches that came meanwhile, in order; one may open a new replay,
        # and then the rest wait for that one.
        held, self._held = self._held, deque()
        while held:
            seq, payload = held.popleft()
            self._on_live(seq, payload)

    # -- decoding ---------------------------------------------------------------

    def _decode(self) -> list[ReceivedBatch]:
        pending, self._pending = self._pending, []
        out: list[ReceivedBatch] = []
        for seq, payload, replayed, epoch in pending:
            try:
                batch, profile = decode_batch_profile(payload)
            except msgspec.DecodeError as exc:
                # Its seq was seen, so account for it where callers look.
                self.stats.malformed += 1
                self.stats.undecodable += 1
                self._lose(seq, seq)
                self._notice(
                    f"seq {seq}: undecodable batch ({len(payload)} bytes): {exc}", flood=True
                )
                continue
            out.append(ReceivedBatch(seq, batch, replayed, epoch, profile))
            self.stats.received += 1
            if replayed:
                self.stats.replayed += 1
        return out

    def _notice(self, text: str, flood: bool = False) -> None:
        """Pass one line to ``on_notice``; ``flood`` lines (bad messages, which a
        hostile peer can send at any rate) only up to a limit, then counted."""
        if flood:
            self._notices += 1
            if self._notices > _NOTICE_LIMIT + 1:
                return
            if self._notices == _NOTICE_LIMIT + 1:
                text = "further malformed or undecodable messages are only counted"
        if self._on_notice is not None:
            self._on_notice(text)

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Every socket closes with linger 0: closing never waits on a peer.
        self._ctx.destroy(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
