"""The replay side of the KV event publisher: a buffer of sent batches and its server.

Replay is served apart from the live path: :class:`ReplayServer` runs its
own thread with its own ZMQ context (so its own I/O thread), and the live
publisher only appends to the shared :class:`ReplayBuffer`. However many
clients ask for the whole buffer and however slowly they read, a live batch
never queues behind a replayed one, in Python or in ZMQ.

Framing is vLLM 0.33's (see ``kvoffload.events.publisher``).

Invariants:

* Each client has at most ``client_hwm`` replay messages queued in ZMQ: the
  ROUTER socket is ``ROUTER_MANDATORY`` with that send high-water mark, so a
  full pipe is an ``EAGAIN`` (the job is parked and retried), never a silent
  drop and never unbounded memory. A job that makes no progress for
  ``stall_s`` (a client that never reads) is abandoned, its pipe left to
  ZMQ's HWM; a client that disconnected is dropped at its next send.
* A request is answered with the batches sent before it arrived that are
  still buffered when their turn comes, in seq order, then the end marker
  (unless abandoned). Open requests are served round-robin, one message at a
  time; beyond ``max_jobs`` a new request gets only the end marker.
* Memory: at most ``client_hwm`` payload copies queued per client in this
  process (plus the kernel's socket buffers), ``max_jobs`` clients.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import cast

import zmq

logger = logging.getLogger(__name__)

#: End-of-replay marker in the seq frame: -1 as 8 signed big-endian bytes.
END_SEQ: bytes = (-1).to_bytes(8, "big", signed=True)
#: Open replay requests served at once; more get the end marker at once.
MAX_REPLAY_JOBS = 1024
#: Replay messages one client may have queued in ZMQ before its job waits.
REPLAY_CLIENT_HWM = 32
#: A replay that cannot send for this long (its client does not read) is abandoned.
REPLAY_STALL_S = 30.0
# How long a parked job (full pipe) waits before it tries again.
_RETRY_S = 0.005
# The replay thread's longest sleep: how soon it notices a stop.
_IDLE_POLL_MS = 100
# Replay messages sent between looks for new requests.
_BURST = 64
#: How much nicer than the process the replay thread runs (Linux).
REPLAY_NICE = 10


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big")


def _lower_priority() -> None:
    """Make the calling thread yield the CPU to the live path (Linux: a thread's nice).

    On a busy host the live thread, its ZMQ I/O thread and the subscribers
    compete with replay for cores; replay is the one that can wait.
    """
    # Not Linux, or not permitted: serve at the process's priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), REPLAY_NICE)


class ReplayBuffer:
    """The last ``capacity`` batches sent, by seq; written by the live thread only.

    Readers (the replay thread) see a consistent pair of bounds under the
    lock; a payload read after its eviction is simply missing (a hole).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._payloads: dict[int, bytes] = {}
        self._order: deque[int] = deque()
        self._lock = threading.Lock()
        self.last_sent_seq = -1

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self.last_sent_seq = seq
            if self.capacity == 0:
                return
            self._payloads[seq] = payload
            self._order.append(seq)
            if len(self._order) > self.capacity:
                del self._payloads[self._order.popleft()]

    def bounds(self) -> tuple[int, int] | None:
        """(first, last) buffered seq, or None when empty."""
        with self._lock:
            if not self._order:
                return None
            return self._order[0], self._order[-1]

    def get(self, seq: int) -> bytes | None:
        return self._payloads.get(seq)

    def seqs(self) -> list[int]:
        with self._lock:
            return list(self._order)


@dataclass
class ReplayStats:
    """Counters, written by the replay thread."""

    requests: int = 0
    replayed_batches: int = 0
    rejected: int = 0
    abandoned: int = 0
    parked: int = 0


@dataclass
class _Job:
    """One replay request being answered: seqs ``next_seq..last_seq`` still to send."""

    envelope: tuple[bytes, ...]
    next_seq: int
    last_seq: int
    stalled_since: float | None = None
    retry_at: float = 0.0
    pending_end: bool = field(default=False)


class ReplayServer:
    """Serves replay requests from ``buffer`` on ``endpoint`` (its own thread and context)."""

    def __init__(
        self,
        endpoint: str,
        buffer: ReplayBuffer,
        topic: bytes,
        vllm_framing: bool,
        *,
        client_hwm: int = REPLAY_CLIENT_HWM,
        max_jobs: int = MAX_REPLAY_JOBS,
        stall_s: float = REPLAY_STALL_S,
        linger_ms: int = 1000,
    ) -> None:
        self.buffer = buffer
        self.topic = topic
        self.vllm_framing = vllm_framing
        self.client_hwm = client_hwm
        self.max_jobs = max_jobs
        self.stall_s = stall_s
        self.stats = ReplayStats()
        self._linger_ms = linger_ms
        # Jobs that may send now (served round-robin), and parked ones (full pipe)
        # in the order they become ready again (all wait the same _RETRY_S).
        self._ready: deque[_Job] = deque()
        self._parked: deque[_Job] = deque()
        self._stop = threading.Event()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.SNDHWM, client_hwm)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.setsockopt(zmq.LINGER, linger_ms)
            self._sock.bind(endpoint)
            value = self._sock.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoint = value.decode() if isinstance(value, bytes) else str(value)
        except BaseException:
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-event-replay", daemon=True
        )
        self._thread.start()

    @property
    def open_jobs(self) -> int:
        return len(self._ready) + len(self._parked)

    def stop(self, timeout_s: float) -> bool:
        """Stop serving (unfinished replays are dropped); False if the thread lingers."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- replay thread -----------------------------------------------------------

    def _run(self) -> None:
        _lower_priority()
        try:
            while not self._stop.is_set():
                self._serve_once()
        except Exception:  # pragma: no cover - a bug here must not kill silently
            logger.exception("KV event replay thread failed")
        finally:
            self._sock.close(linger=self._linger_ms)
            self._ctx.term()

    def _serve_once(self) -> None:
        now = time.monotonic()
        parked, ready = self._parked, self._ready
        while parked and parked[0].retry_at <= now:
            ready.append(parked.popleft())
        if not ready:
            wait_ms = _IDLE_POLL_MS
            if parked:
                wait_ms = max(1, min(wait_ms, int((parked[0].retry_at - now) * 1000) + 1))
            if self._sock.poll(wait_ms, zmq.POLLIN):
                self._take_requests()
            return
        # Requests first (cheap check, no syscall), so each is answered from
        # what was sent before it arrived.
        # ZMQ_EVENTS is an int option (pyzmq types every option's value as a union).
        if cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._take_requests()
        for _ in range(_BURST):
            if not ready:
                return
            self._send_next(now)

    def _take_requests(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._open(frames)

    def _open(self, frames: list[bytes]) -> None:
        # [identity, b"", start] from REQ (or a DEALER sending the delimiter),
        # [identity, start] from a bare DEALER.
        if len(frames) == 3 and frames[1] == b"":
            envelope: tuple[bytes, ...] = (frames[0], b"")
        elif len(frames) == 2:
            envelope = (frames[0],)
        else:
            logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        self.stats.requests += 1
        start = frames[-1]
        if len(start) != 8:
            logger.warning("KV event replay request with a %d-byte seq; want 8", len(start))
            # Always terminate, so that a waiting client never hangs on a bad request.
            self._ready.append(_Job(envelope, 0, -1, pending_end=True))
            return
        if self.open_jobs >= self.max_jobs:
            self.stats.rejected += 1
            self._ready.append(_Job(envelope, 0, -1, pending_end=True))
            return
        self._ready.append(_Job(envelope, seq_from_bytes(start), self.buffer.last_sent_seq))

    def _send_next(self, now: float) -> None:
        """One message for the first ready job, then it goes to the back (or parks, or ends)."""
        ready = self._ready
        job = ready.popleft()
        frames, seq = self._next_frames(job)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            # The client's pipe is full: it reads slowly or not at all.
            if job.stalled_since is None:
                job.stalled_since = now
                self.stats.parked += 1
            if now - job.stalled_since >= self.stall_s:
                self.stats.abandoned += 1
                return
            job.retry_at = now + _RETRY_S
            self._parked.append(job)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return  # the client went away
        job.stalled_since = None
        if seq is None:
            return
        self.stats.replayed_batches += 1
        job.next_seq = seq + 1
        ready.append(job)

    def _next_frames(self, job: _Job) -> tuple[tuple[bytes, ...], int | None]:
        """The job's next message and its seq (None: the end marker)."""
        seq, last = job.next_seq, job.last_seq
        bounds = None if job.pending_end else self.buffer.bounds()
        if bounds is None:
            last = -1
        else:
            seq = max(seq, bounds[0])
            last = min(last, bounds[1])
        # Seqs of dropped or unsendable batches are holes; the walk is bounded
        # by the buffer's span.
        payload = None
        while seq <= last:
            payload = self.buffer.get(seq)
            if payload is not None:
                break
            seq += 1
        if payload is None:
            if self.vllm_framing:
                return (*job.envelope, b"", END_SEQ, b""), None
            return (*job.envelope, END_SEQ, b""), None
        if self.vllm_framing:
            return (*job.envelope, self.topic, seq_to_bytes(seq), payload), seq
        return (*job.envelope, seq_to_bytes(seq), payload), seq
