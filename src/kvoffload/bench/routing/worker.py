"""The engine instances of the routing bench, each in its own process.

An :class:`EngineProcess` is a process that runs one reference engine
(``LLMEngine``) at a time, with its own GPU and CPU tiers, the shared Redis
tier named by its config, and KV events published on its own ZMQ endpoints.
Each routed run builds a fresh engine in it (``start_engine``: empty tiers,
new endpoints) and ends it (``stop``); the process, with torch imported,
stays for the next run. The parent talks to it over a pipe only, so the same
messages could go over a socket to an engine on another host:

* parent -> child: ``("engine", config)`` builds an engine; then ``("add",
  req_id, token_ids, max_tokens, continues)`` and ``("stop",)``; ``("exit",)``
  ends the process;
* child -> parent: ``("ready",)`` once the engine is built, one ``("out",
  {...})`` per finished request, ``("stats", {...})`` after ``stop`` (the
  engine drained, its events flushed, closed), ``("error", line, traceback)``
  if the engine failed (the process then exits).

Invariant: every request added is answered by exactly one ``out`` before
``stats``; the child steps the engine whenever it holds work and blocks on
the pipe only when it holds none.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypedDict

from kvoffload.engine.config import EngineConfig

READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class InstanceEndpoints:
    """Where an instance publishes its KV events (what a router registers with the indexer)."""

    instance_id: int
    events: str
    replay: str


class RequestRecord(TypedDict):
    """One finished request, as an engine process reports it (``("out", record)``)."""

    req_id: str
    prompt_len: int
    ttft_s: float
    latency_s: float
    gpu_hit: int
    tier_hit: int
    computed: int
    output_tokens: int


class EngineStats(TypedDict):
    """An engine's final figures (``("stats", stats)``): tokens hit per lower tier."""

    tiers: dict[str, int]


def _output_dict(out: Any) -> RequestRecord:
    return {
        "req_id": out.req_id,
        "prompt_len": out.prompt_len,
        "ttft_s": out.ttft_s,
        "latency_s": out.latency_s,
        "gpu_hit": out.num_gpu_hit_tokens,
        "tier_hit": out.num_tier_hit_tokens,
        "computed": out.num_prefill_tokens_computed,
        "output_tokens": len(out.output_token_ids),
    }


def _serve(conn: Connection, config: EngineConfig) -> None:
    from kvoffload.engine.llm_engine import LLMEngine
    from kvoffload.engine.request import SamplingParams

    engine = LLMEngine(config)
    try:
        conn.send(("ready",))
        stopping = False
        while True:
            busy = engine.has_unfinished_requests()
            # Block on the pipe only when the engine has nothing to do.
            while conn.poll(0 if busy or stopping else 0.05):
                msg = conn.recv()
                if msg[0] == "add":
                    _, req_id, tokens, max_tokens, continues = msg
                    engine.add_request(
                        tokens, SamplingParams(max_tokens=max_tokens), req_id, continues
                    )
                    busy = True
                elif msg[0] == "stop":
                    stopping = True
                    break
            if engine.has_unfinished_requests():
                for out in engine.step():
                    conn.send(("out", _output_dict(out)))
            elif stopping:
                break
            else:
                engine.step()  # settles finished transfers and publishes their events
        engine.drain()
        engine.step()
        flush = getattr(engine.publisher, "flush", None)
        if flush is not None:
            flush()
        conn.send(("stats", {"tiers": engine.tier_hit_breakdown() or {}}))
    finally:
        engine.close()


def _main(conn: Connection) -> None:
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                break
            if msg[0] == "engine":
                _serve(conn, msg[1])
    except EOFError:
        pass  # the parent went away
    except Exception as exc:  # the parent must hear why, in one line
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", line, traceback.format_exc()))
    finally:
        conn.close()


class EngineProcess:
    """One engine process; the protocol is in the module docstring."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.endpoints: InstanceEndpoints | None = None
        ctx = mp.get_context("spawn")  # a fork would copy the parent's torch threads
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child,), name=f"engine-{index}", daemon=True)
        self.process.start()
        child.close()

    def recv(self, timeout_s: float | None = None) -> tuple[Any, ...]:
        """The next message (a tuple tagged by its first item; see the module docstring)."""
        if timeout_s is not None and not self.conn.poll(timeout_s):
            raise RuntimeError(f"engine process {self.index}: no answer in {timeout_s:.0f}s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"engine process {self.index} exited (exit code {self.process.exitcode})"
            ) from None
        if msg[0] == "error":
            raise RuntimeError(f"engine process {self.index}: {msg[1]}")
        return msg

    def start_engine(self, endpoints: InstanceEndpoints, config: EngineConfig) -> None:
        """Build a fresh engine publishing on ``endpoints`` (waits until it is ready)."""
        self.endpoints = endpoints
        self.conn.send(("engine", config))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        msg = self.recv(timeout_s)
        if msg[0] != "ready":
            raise RuntimeError(f"engine process {self.index}: expected ready, got {msg[0]!r}")

    def add(self, req_id: str, token_ids: list[int], max_tokens: int, continues: bool) -> None:
        self.conn.send(("add", req_id, token_ids, max_tokens, continues))

    def stop(self) -> EngineStats:
        """End the engine (after its outstanding requests); its final stats."""
        self.conn.send(("stop",))
        while True:
            msg = self.recv()
            if msg[0] == "stats":
                stats: EngineStats = msg[1]
                return stats

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("exit",))
        self.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
