"""The subscriber's replay client: a DEALER socket asking a publisher for old batches.

It speaks the replay protocol of :mod:`kvoffload.events.publisher` (vLLM
0.33's framing, or the legacy one) and only moves bytes: which seqs to ask
for and what to make of the answer is :class:`KVEventSubscriber`'s job.

Invariants:

* At most one request is open; its deadline moves on with every reply, so a
  request times out only after ``timeout_s`` without any reply.
* A request that timed out closes the socket and opens a new one: late
  replies to it can never pass for the next request's.
* After a timeout, requests back off (``backoff_s``, doubling at each further
  timeout up to ``backoff_max_s``); a request that is answered to its end
  resets the backoff.
* A malformed reply is counted in the subscriber's stats and reported, never
  taken as a batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvoffload.events.publisher import END_SEQ, seq_from_bytes, seq_to_bytes

if TYPE_CHECKING:
    from kvoffload.events.subscriber import SubscriberStats

#: Passes one line on; ``True`` marks a line a hostile peer could flood.
Notice = Callable[[str, bool], None]


@dataclass
class ReplayRequest:
    """An open replay request for seqs from ``first`` on."""

    first: int
    # The live batch that revealed the gap (None for the start_seq catch-up).
    live: tuple[int, bytes] | None
    deadline: float
    got: list[tuple[int, bytes]] = field(default_factory=list)
    # Asked after a jump (a new epoch): only a stream that starts far ahead of
    # ``first`` (a restarted publisher's) belongs to it.
    resync: bool = False


class ReplayClient:
    """One DEALER socket to a publisher's replay endpoint, one request at a time."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        timeout_s: float,
        backoff_s: float,
        backoff_max_s: float,
        stats: SubscriberStats,
        notice: Notice,
    ) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._timeout_s = timeout_s
        self._backoff_min_s = backoff_s
        self._backoff_max_s = max(backoff_s, backoff_max_s)
        self._backoff_s = 0.0
        self._backoff_until = 0.0
        self._stats = stats
        self._notice = notice
        self.request: ReplayRequest | None = None
        self._dealer: zmq.Socket | None = self._new_dealer()

    @property
    def connected(self) -> bool:
        """False once the socket was lost: gaps can then only be reported."""
        return self._dealer is not None

    @property
    def backing_off(self) -> bool:
        return time.monotonic() < self._backoff_until

    @property
    def expired(self) -> bool:
        """An open request that got no reply for ``timeout_s``."""
        return self.request is not None and time.monotonic() >= self.request.deadline

    def poll_socket(self) -> zmq.Socket | None:
        """The socket to poll while a request is open, else None."""
        return self._dealer if self.request is not None else None

    def ask(self, first: int, live: tuple[int, bytes] | None, *, resync: bool = False) -> bool:
        """Open a request for seqs from ``first`` on; False when it could not be sent
        (the request is then open and must be closed as timed out)."""
        assert self._dealer is not None
        self.request = ReplayRequest(first, live, time.monotonic() + self._timeout_s, resync=resync)
        try:
            # The empty delimiter makes the request look like REQ's, which
            # vLLM's publisher requires; replies then carry it too.
            self._dealer.send_multipart((b"", seq_to_bytes(first)), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def read(self) -> bool:
        """Take the replies readable now into the open request; True at its end marker."""
        request = self.request
        dealer = self._dealer
        assert request is not None and dealer is not None
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            request.deadline = time.monotonic() + self._timeout_s
            if frames and frames[0] == b"":
                frames = frames[1:]
            # vLLM profile: [topic, seq, payload]; legacy: [seq, payload].
            if len(frames) == 3:
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                self._stats.malformed += 1
                self._notice(f"malformed replay message ({len(frames)} frames) ignored", True)
                continue
            if frames[0] == END_SEQ:
                return True
            request.got.append((seq_from_bytes(frames[0]), frames[1]))

    def close_request(self, *, timed_out: bool) -> ReplayRequest:
        """Close the open request and return it, backing off if it ``timed_out``."""
        request = self.request
        assert request is not None
        self.request = None
        if not timed_out:
            self._backoff_s = 0.0
            self._backoff_until = 0.0
            return request
        self._stats.replay_timeouts += 1
        self._backoff_s = min(self._backoff_max_s, max(2 * self._backoff_s, self._backoff_min_s))
        self._backoff_until = time.monotonic() + self._backoff_s
        self._notice(
            f"replay from seq {request.first} timed out after {len(request.got)} batches; "
            f"replays paused for {self._backoff_s:g} s",
            False,
        )
        # Late replies to this request must not pass for the next one's.
        self._reset_dealer()
        return request

    def _new_dealer(self) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            dealer.connect(self.endpoint)
        except zmq.ZMQError:
            dealer.close(linger=0)
            raise
        return dealer

    def _reset_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        try:
            self._dealer = self._new_dealer()
        except zmq.ZMQError as exc:  # pragma: no cover - it connected before
            self._notice(f"replay socket lost ({exc}); gaps are now only reported", False)
