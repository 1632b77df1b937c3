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
* Seqs start at ``first_seq`` (0, as vLLM's, unless given; an engine passes
  :func:`restart_safe_first_seq`) and grow by one per ``publish`` call. A
  batch dropped because
  the queue was full still consumes its seq, so subscribers see the loss as a
  gap that replay cannot fill, rather than silently missing state.
* Batches go out in seq order; the replay buffer holds the last
  ``buffer_steps`` batches actually sent.
* Live batches never wait behind replays: the live socket thread only sends
  and appends to the replay buffer; replay requests are served by
  :class:`kvoffload.events.replay.ReplayServer` on its own thread and ZMQ
  context, bounded per client (see that module). A replay request is
  answered with the batches sent before it arrived (those still buffered
  when their turn comes); beyond ``MAX_REPLAY_JOBS`` open requests a new one
  gets only the end marker.
* ``shutdown`` sends everything accepted before it, then closes the sockets
  and joins the threads within a bounded time; unfinished replays are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import zmq

from kvoffload.events.replay import (
    END_SEQ,
    MAX_REPLAY_JOBS,
    REPLAY_CLIENT_HWM,
    REPLAY_STALL_S,
    ReplayBuffer,
    ReplayServer,
    ReplayStats,
    seq_from_bytes,
    seq_to_bytes,
)
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

DEFAULT_ENDPOINT = "tcp://*:5557"
#: vLLM 0.33's default topic (``KVEventsConfig.topic``).
DEFAULT_TOPIC = ""
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000
__all__ = [
    "END_SEQ",
    "MAX_REPLAY_JOBS",
    "EventPublisher",
    "NullEventPublisher",
    "PublisherStats",
    "ZmqEventPublisher",
    "make_publisher",
    "restart_safe_first_seq",
    "seq_from_bytes",
    "seq_to_bytes",
]

# How many queued batches the socket thread sends between checks for shutdown.
_SEND_CHUNK = 256
# 2025-01-01T00:00:00Z: restart-safe seqs count seconds from here; shifted by
# _SEQ_SECOND_SHIFT they stay below 2**63 (END_SEQ is -1) until 2059.
_SEQ_EPOCH_S = 1_735_689_600
# Seconds are shifted past a subscriber's believable gap (2**32 batches), so a
# restart a second or more later reads as a new stream, not as lost batches.
_SEQ_SECOND_SHIFT = 33


def restart_safe_first_seq(now_s: float | None = None) -> int:
    """A first seq above any seq an earlier incarnation (started a second or more
    before) can have reached.

    Routers that keep the last seq per instance (Dynamo's indexer) drop a
    restarted publisher's batches until its seq passes the old one; starting
    above it, the restart's first batch (``AllBlocksCleared``) is applied at
    once. kvoffload's subscriber reads the jump as a resync (a new epoch).
    """
    now = time.time() if now_s is None else now_s
    return max(0, int(now) - _SEQ_EPOCH_S) << _SEQ_SECOND_SHIFT


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
    """Counters; written by the socket thread (``dropped_batches`` by publish, ``replay``
    by the replay thread)."""

    published_batches: int = 0
    dropped_batches: int = 0
    send_errors: int = 0
    replay: ReplayStats = field(default_factory=ReplayStats)

    @property
    def replay_requests(self) -> int:
        return self.replay.requests

    @property
    def replayed_batches(self) -> int:
        return self.replay.replayed_batches

    @property
    def replay_rejected(self) -> int:
        return self.replay.rejected


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
    ``replay_client_hwm`` / ``replay_stall_s``: replay messages one client may
    have queued, and how long a replay that cannot send lives
    (:mod:`kvoffload.events.replay`).
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
        replay_client_hwm: int = REPLAY_CLIENT_HWM,
        replay_stall_s: float = REPLAY_STALL_S,
        first_seq: int = 0,
    ) -> None:
        if not endpoint:
            raise ValueError("KV events endpoint must not be empty")
        if not 0 <= first_seq < 1 << 63:
            raise ValueError(f"first_seq must be in [0, 2**63), got {first_seq}")
        if buffer_steps < 0 or hwm < 0 or max_queue_size < 1:
            raise ValueError(
                f"need buffer_steps >= 0, hwm >= 0, max_queue_size >= 1; got "
                f"{buffer_steps}, {hwm}, {max_queue_size}"
            )
        self.profile = check_profile(profile)
        self._int_hashes = vllm_int_hashes_from_env() if int_hashes is None else int_hashes
        self._requested_endpoint = endpoint
        self._requested_replay_endpoint = replay_endpoint or None
        self._bind_names = f"({endpoint!r}, replay {replay_endpoint!r})"
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
        self._next_seq = first_seq
        self._closed = False
        self._stop = threading.Event()
        # A socketpair wakes the socket thread's zmq poll when the queue gets
        # work, so the thread sleeps without a busy poll and the engine thread
        # touches no ZMQ socket.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

        # Written by the socket thread, read by the replay thread (seqs of
        # dropped batches are absent).
        self._buffer = ReplayBuffer(buffer_steps)
        self._replay: ReplayServer | None = None
        self.endpoint: str = endpoint
        self.replay_endpoint: str | None = self._requested_replay_endpoint
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-event-publisher", daemon=True
        )
        self._start_socket_thread(start_timeout_s)
        if self._requested_replay_endpoint is not None:
            self._start_replay_server(
                self._requested_replay_endpoint, replay_client_hwm, replay_stall_s
            )

    def _start_socket_thread(self, start_timeout_s: float) -> None:
        """Start the socket thread and wait until its PUB socket is bound."""
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            self._abort_start()
            raise OSError(f"KV event publisher did not start within {start_timeout_s} s")
        if self._start_error is not None:
            self._thread.join(self._shutdown_timeout_s)
            self._close_wake()
            raise OSError(
                f"cannot bind KV event sockets {self._bind_names}: {self._start_error}"
            ) from self._start_error

    def _start_replay_server(self, endpoint: str, client_hwm: int, stall_s: float) -> None:
        """Bind the replay socket (its own thread) over the shared buffer."""
        try:
            self._replay = ReplayServer(
                endpoint,
                self._buffer,
                self._topic_bytes,
                self.profile == PROFILE_VLLM,
                client_hwm=client_hwm,
                stall_s=stall_s,
                linger_ms=self._linger_ms,
            )
        except zmq.ZMQError as exc:
            self._abort_start()
            raise OSError(f"cannot bind KV event sockets {self._bind_names}: {exc}") from exc
        self.replay_endpoint = self._replay.endpoint
        self.stats.replay = self._replay.stats

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
        return self._buffer.seqs()

    @property
    def open_replays(self) -> int:
        """Replay requests being answered now (for tests and tools)."""
        return 0 if self._replay is None else self._replay.open_jobs

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake()
        replay_stopped = self._replay is None or self._replay.stop(self._shutdown_timeout_s)
        self._thread.join(self._shutdown_timeout_s)
        if self._thread.is_alive() or not replay_stopped:
            logger.warning(
                "KV event publisher threads did not stop within %s s", self._shutdown_timeout_s
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
        # Its own context (own ZMQ I/O thread): replay traffic never shares it.
        ctx = zmq.Context(io_threads=1)
        pub: zmq.Socket | None = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, self.hwm)
                pub.setsockopt(zmq.LINGER, self._linger_ms)
                pub.bind(self._requested_endpoint)
                self.endpoint = _last_endpoint(pub)
            except zmq.ZMQError as exc:
                self._start_error = exc
                return
            finally:
                self._ready.set()
            self._serve(pub)
        except Exception:  # pragma: no cover - a bug here must not kill silently
            logger.exception("KV event publisher thread failed")
        finally:
            if pub is not None:
                pub.close(linger=self._linger_ms)
            ctx.term()

    def _serve(self, pub: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            self._drain_wake()
            more_live = self._send_queued(pub, _SEND_CHUNK)
            if self._stop.is_set():
                # shutdown() set _closed under publish()'s lock before _stop,
                # so every accepted batch is already queued: this drain is the
                # last one needed.
                while self._send_queued(pub, _SEND_CHUNK):
                    pass
                return
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
                self._buffer.append(seq, payload)
                self.stats.published_batches += 1
            finally:
                self._queue.task_done()
        return True


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
    first_seq: int = 0,
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
        first_seq=first_seq,
    )
