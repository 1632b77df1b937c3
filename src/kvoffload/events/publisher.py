"""KV event publishers: a null one and a ZMQ one that speaks vLLM 0.33's protocol.

Wire protocol (vLLM 0.33's ``ZmqEventPublisher``, so routers written against
it, such as llm-d and Dynamo, consume ours unchanged):

* PUB socket, one multipart message per batch:
  ``[topic, seq as 8-byte big-endian unsigned, payload]``, the payload a
  msgpack batch in the publisher's wire profile (see
  :mod:`kvoffload.events.types`).
* ROUTER replay socket. A client (DEALER or REQ) sends the first seq it wants
  as 8 big-endian bytes, after an empty delimiter frame (REQ adds it; vLLM
  requires it, we also accept a bare DEALER request). In the ``"vllm"``
  profile it gets ``[b"", topic, seq, payload]`` per buffered batch with
  ``seq >= start``, in order, then ``[b"", b"", END_SEQ, b""]``; in the
  ``"legacy"`` profile ``[b"", seq, payload]`` and ``[b"", END_SEQ, b""]``.
  ``END_SEQ`` is -1 as 8 signed big-endian bytes. A bare DEALER request is
  answered without the leading delimiter.

Invariants of :class:`ZmqEventPublisher`:

* ``publish`` never blocks on ZMQ and never touches a socket: it stamps the
  batch, takes the next seq and hands both to the socket thread through a
  bounded queue. All sockets live on that one thread.
* Seqs start at 0 and grow by one per ``publish`` call. A batch dropped because
  the queue was full still consumes its seq, so subscribers see the loss as a
  gap that replay cannot fill, rather than silently missing state.
* Batches go out in seq order; the replay buffer holds the last
  ``buffer_steps`` batches actually sent.
* Live batches come first: the socket thread sends at most one replay message
  between looking at the live queue, so any number of replay requests delays a
  live batch by at most one replayed batch. A replay request is answered
  with the batches sent before it arrived (those still buffered when their
  turn comes); concurrent requests are answered round-robin, and beyond
  ``MAX_REPLAY_JOBS`` open requests a new one gets only the end marker.
* ``shutdown`` sends everything accepted before it, then closes the sockets
  and joins the thread within a bounded time; unfinished replays are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import zmq

from kvoffload.events.types import (
    DEFAULT_PROFILE,
    PROFILE_VLLM,
    KVEvent,
    KVEventBatch,
    check_profile,
    encode_batch,
    vllm_int_hashes_from_env,
)

logger = logging.getLogger(__name__)

#: End-of-replay marker in the seq frame: -1 as 8 signed big-endian bytes.
END_SEQ: bytes = (-1).to_bytes(8, "big", signed=True)

DEFAULT_ENDPOINT = "tcp://*:5557"
#: vLLM 0.33's default topic (``KVEventsConfig.topic``).
DEFAULT_TOPIC = ""
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000
#: Open replay requests served at once; more get the end marker at once.
MAX_REPLAY_JOBS = 1024

# How many queued batches the socket thread sends before it serves one replay
# message, so that a backlog does not starve replay clients.
_SEND_CHUNK = 256


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big")


class EventPublisher(ABC):
    """Takes one batch of KV events per engine step and ships it somewhere."""

    @abstractmethod
    def publish(self, events: Sequence[KVEvent] | KVEventBatch) -> bool:
        """Queue ``events`` (or a ready batch) for sending; never blocks.

        Returns False when the batch was not accepted (publisher shut down or
        its queue full).
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Flush what was accepted and release all resources; idempotent."""

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """The publisher when events are disabled: accepts and discards."""

    def publish(self, events: Sequence[KVEvent] | KVEventBatch) -> bool:
        return True

    def shutdown(self) -> None:
        return None


@dataclass
class PublisherStats:
    """Counters; written by the socket thread (``dropped_batches`` by publish)."""

    published_batches: int = 0
    dropped_batches: int = 0
    send_errors: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    replay_rejected: int = 0


@dataclass
class _ReplayJob:
    """One replay request being answered: seqs ``next_seq..last_seq`` still to send."""

    envelope: tuple[bytes, ...]
    next_seq: int
    last_seq: int


class ZmqEventPublisher(EventPublisher):
    """Publishes KV event batches on ZMQ PUB with a ROUTER replay socket.

    ``endpoint`` and ``replay_endpoint`` are bound (a port of ``*`` lets the OS
    choose; read the result from :attr:`endpoint` / :attr:`replay_endpoint`).
    ``replay_endpoint=None`` disables replay. ``hwm`` is the PUB socket's send
    high-water mark per subscriber (ZMQ drops beyond it, never blocks);
    ``buffer_steps`` is how many recent batches replay can serve;
    ``max_queue_size`` bounds the hand-off queue to the socket thread.
    ``data_parallel_rank`` is stamped into batches built from event lists (the
    ``"vllm"`` profile sends None as 0, as vLLM does). ``profile`` is the wire
    profile, ``"vllm"`` or ``"legacy"``; ``int_hashes`` (vllm profile) None
    follows ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` as vLLM does.
    """

    END_SEQ: ClassVar[bytes] = END_SEQ

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        topic: str = DEFAULT_TOPIC,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        data_parallel_rank: int | None = None,
        *,
        profile: str = DEFAULT_PROFILE,
        int_hashes: bool | None = None,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        linger_s: float = 1.0,
        start_timeout_s: float = 10.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        if not endpoint:
            raise ValueError("KV events endpoint must not be empty")
        if buffer_steps < 0 or hwm < 0 or max_queue_size < 1:
            raise ValueError(
                f"need buffer_steps >= 0, hwm >= 0, max_queue_size >= 1; got "
                f"{buffer_steps}, {hwm}, {max_queue_size}"
            )
        self.profile = check_profile(profile)
        self._int_hashes = vllm_int_hashes_from_env() if int_hashes is None else int_hashes
        self._requested_endpoint = endpoint
        self._requested_replay_endpoint = replay_endpoint or None
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self._linger_ms = max(0, int(linger_s * 1000))
        self._shutdown_timeout_s = shutdown_timeout_s
        self.stats = PublisherStats()

        # Hand-off from the engine thread: (seq, batch). Guarded by _lock so
        # that no batch can slip in after shutdown's final drain began.
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(max_queue_size)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._closed = False
        self._stop = threading.Event()
        # A socketpair wakes the socket thread's zmq poll when the queue gets
        # work, so the thread sleeps without a busy poll and the engine thread
        # touches no ZMQ socket.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

        # Replay buffer, socket thread only: seq -> payload, and the seqs in
        # send order for eviction (seqs of dropped batches are absent).
        self._buffer: dict[int, bytes] = {}
        self._buffer_order: deque[int] = deque()
        self._last_sent_seq = -1
        self._jobs: deque[_ReplayJob] = deque()
        self.endpoint: str = endpoint
        self.replay_endpoint: str | None = self._requested_replay_endpoint
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-event-publisher", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            self._abort_start()
            raise OSError(f"KV event publisher did not start within {start_timeout_s} s")
        if self._start_error is not None:
            self._thread.join(self._shutdown_timeout_s)
            self._close_wake()
            raise OSError(
                f"cannot bind KV event sockets ({endpoint!r}, replay {replay_endpoint!r}): "
                f"{self._start_error}"
            ) from self._start_error

    # -- engine thread ----------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next ``publish`` call takes (a dropped batch takes one too)."""
        return self._next_seq

    def publish(self, events: Sequence[KVEvent] | KVEventBatch) -> bool:
        if isinstance(events, KVEventBatch):
            batch = events
        else:
            batch = KVEventBatch(
                ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank
            )
        with self._lock:
            if self._closed:
                return False
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self.stats.dropped_batches += 1
                return False
        self._wake()
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every batch accepted so far left the socket thread.

        For tests and orderly hand-offs; the engine never needs to call it.
        Returns False on timeout.
        """
        deadline = time.monotonic() + timeout_s
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                done.wait(min(remaining, 0.1))
        return True

    def buffered_seqs(self) -> list[int]:
        """The seqs replay can serve now (a snapshot; for tests and tools)."""
        return list(self._buffer_order)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake()
        self._thread.join(self._shutdown_timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "KV event publisher thread did not stop within %s s", self._shutdown_timeout_s
            )
            return
        self._close_wake()

    def _wake(self) -> None:
        # A full socketpair already means "wake up"; a closed one means we are
        # past shutdown.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\x00")

    def _close_wake(self) -> None:
        self._wake_r.close()
        self._wake_w.close()

    def _abort_start(self) -> None:
        with self._lock:
            self._closed = True
        self._stop.set()
        self._wake()
        self._thread.join(self._shutdown_timeout_s)
        if not self._thread.is_alive():
            self._close_wake()

    # -- socket thread ----------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        pub: zmq.Socket | None = None
        replay: zmq.Socket | None = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, self.hwm)
                pub.setsockopt(zmq.LINGER, self._linger_ms)
                pub.bind(self._requested_endpoint)
                self.endpoint = _last_endpoint(pub)
                if self._requested_replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    # A full replay of the buffer must fit in one client's
                    # pipe, or ROUTER would silently drop its tail; ZMQ frees
                    # pipe room only every HWM/2 reads, hence the 2x (as vLLM).
                    replay_hwm = 0 if self.hwm == 0 else 2 * (self.buffer_steps + 1)
                    replay.setsockopt(zmq.SNDHWM, replay_hwm)
                    replay.setsockopt(zmq.LINGER, self._linger_ms)
                    replay.bind(self._requested_replay_endpoint)
                    self.replay_endpoint = _last_endpoint(replay)
            except zmq.ZMQError as exc:
                self._start_error = exc
                return
            finally:
                self._ready.set()
            self._serve(pub, replay)
        except Exception:  # pragma: no cover - a bug here must not kill silently
            logger.exception("KV event publisher thread failed")
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=self._linger_ms)
            ctx.term()

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            self._drain_wake()
            # Requests first, so each is answered from what was sent before it.
            self._take_replay_requests(replay)
            more_live = self._send_queued(pub, _SEND_CHUNK)
            if self._stop.is_set():
                # shutdown() set _closed under publish()'s lock before _stop,
                # so every accepted batch is already queued: this drain is the
                # last one needed.
                while self._send_queued(pub, _SEND_CHUNK):
                    pass
                return
            if self._jobs and replay is not None:
                # One replay message, then back to the live queue.
                self._send_one_replay(replay)
                continue
            if more_live:
                continue
            poller.poll()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def _send_queued(self, pub: zmq.Socket, limit: int) -> bool:
        """Send up to ``limit`` queued batches; True if more may be waiting."""
        for _ in range(limit):
            try:
                seq, batch = self._queue.get_nowait()
            except queue.Empty:
                return False
            try:
                payload = encode_batch(batch, self.profile, int_hashes=self._int_hashes)
                # PUB never blocks: at the HWM it drops for that subscriber.
                pub.send_multipart((self._topic_bytes, seq_to_bytes(seq), payload), copy=False)
            except Exception:
                # One bad batch (unencodable event, socket error) must not
                # take the stream down; its seq becomes an unreplayable gap.
                self.stats.send_errors += 1
                logger.exception("KV event batch seq=%d could not be sent", seq)
            else:
                self._remember(seq, payload)
                self.stats.published_batches += 1
            finally:
                self._queue.task_done()
        return True

    def _remember(self, seq: int, payload: bytes) -> None:
        self._last_sent_seq = seq
        if self.buffer_steps == 0:
            return
        self._buffer[seq] = payload
        self._buffer_order.append(seq)
        if len(self._buffer_order) > self.buffer_steps:
            del self._buffer[self._buffer_order.popleft()]

    def _take_replay_requests(self, replay: zmq.Socket | None) -> None:
        if replay is None:
            return
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._open_replay(replay, frames)

    def _open_replay(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        # [identity, b"", start] from REQ (or a DEALER sending the delimiter),
        # [identity, start] from a bare DEALER.
        if len(frames) == 3 and frames[1] == b"":
            envelope: tuple[bytes, ...] = (frames[0], b"")
        elif len(frames) == 2:
            envelope = (frames[0],)
        else:
            logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        self.stats.replay_requests += 1
        start = frames[-1]
        if len(start) != 8:
            logger.warning("KV event replay request with a %d-byte seq; want 8", len(start))
            # Always terminate, so that a waiting client never hangs on a bad request.
            self._send_end(replay, envelope)
            return
        if len(self._jobs) >= MAX_REPLAY_JOBS:
            self.stats.replay_rejected += 1
            self._send_end(replay, envelope)
            return
        self._jobs.append(_ReplayJob(envelope, seq_from_bytes(start), self._last_sent_seq))

    def _send_one_replay(self, replay: zmq.Socket) -> None:
        """Send the next message of the oldest open replay, then rotate the jobs."""
        job = self._jobs[0]
        seq = job.next_seq
        last = job.last_seq
        if self._buffer_order:
            seq = max(seq, self._buffer_order[0])
            last = min(last, self._buffer_order[-1])
        else:
            last = -1
        # Seqs of dropped or unsendable batches are holes in the buffer; the
        # walk is bounded by the buffer's span.
        while seq <= last and seq not in self._buffer:
            seq += 1
        if seq > last:
            self._jobs.popleft()
            self._send_end(replay, job.envelope)
            return
        if self.profile == PROFILE_VLLM:
            frames = (*job.envelope, self._topic_bytes, seq_to_bytes(seq), self._buffer[seq])
        else:
            frames = (*job.envelope, seq_to_bytes(seq), self._buffer[seq])
        replay.send_multipart(frames, copy=False)
        self.stats.replayed_batches += 1
        job.next_seq = seq + 1
        self._jobs.rotate(-1)

    def _send_end(self, replay: zmq.Socket, envelope: tuple[bytes, ...]) -> None:
        if self.profile == PROFILE_VLLM:
            replay.send_multipart((*envelope, b"", END_SEQ, b""))
        else:
            replay.send_multipart((*envelope, END_SEQ, b""))


def _last_endpoint(sock: zmq.Socket) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)


def make_publisher(
    endpoint: str | None = None,
    replay_endpoint: str | None = None,
    topic: str = DEFAULT_TOPIC,
    buffer_steps: int = DEFAULT_BUFFER_STEPS,
    hwm: int = DEFAULT_HWM,
    data_parallel_rank: int | None = None,
    *,
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
    events_format: str = DEFAULT_PROFILE,
) -> EventPublisher:
    """A :class:`ZmqEventPublisher` speaking ``events_format`` ("vllm" or "legacy").

    The null publisher when ``endpoint`` is None (``events_format`` is still
    checked, so a typo fails at once).
    """
    check_profile(events_format)
    if endpoint is None:
        return NullEventPublisher()
    return ZmqEventPublisher(
        endpoint,
        replay_endpoint,
        topic,
        buffer_steps,
        hwm,
        data_parallel_rank,
        max_queue_size=max_queue_size,
        profile=events_format,
    )
