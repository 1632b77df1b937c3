"""Spawned worker processes, one per TP rank, each serving one rank of an engine at a time.

Used by ``vllm_tp_rig`` and ``vllm_groups_tp_rig`` (their scheduler sides
share ``PoolDriver``'s loop); each passes its own rank
class, a module-level class (so ``spawn`` can pickle it by name) built as
``make_rank(rank, build)`` in the worker and holding ``connector`` (vLLM's
worker-side connector), ``worker`` (its kvoffload worker), ``step(*args)``
and ``stats()``.

Invariant: every command gets exactly one answer from every rank, ("ok",
value) or ("error", text); the pool raises the first error it reads, so a
failure in a worker ends the test with that rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from tests.integrations.vllm_step_parts import has_pending_work

#: Generous: on a loaded 2-core machine a spawned worker imports vLLM in minutes.
STEP_TIMEOUT_S = 600.0


def rank_stats(rank: Any) -> dict[str, Any]:
    """What every rank reports: loaded bytes and blocks verified, mismatches, jobs in flight."""
    return {
        "bytes_verified": rank.bytes_verified,
        "blocks_verified": rank.blocks_verified,
        "mismatches": list(rank.mismatches),
        "in_flight": rank.worker.num_in_flight(),
    }


def serve_rank(rank: int, conn: Connection, make_rank: Any) -> None:
    """Serve commands until "exit": build an engine's rank, step it, report, shut it down."""
    import kvoffload.integrations.vllm.connector  # noqa: F401 - vLLM imported before "ready"

    conn.send(("ok", "ready"))
    rig: Any = None
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                if rig is not None:
                    rig.connector.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "build":
                rig = make_rank(rank, args)
                conn.send(("ok", None))
            elif cmd == "step":
                assert rig is not None
                conn.send(("ok", rig.step(*args)))
            elif cmd == "wait":
                assert rig is not None
                rig.worker.wait_all(timeout=60)
                conn.send(("ok", rig.stats()))
            elif cmd == "stats":
                assert rig is not None
                conn.send(("ok", rig.stats()))
            elif cmd == "shutdown":
                if rig is not None:
                    rig.connector.shutdown()
                rig = None
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as exc:  # reported to the test process, which raises it
            import traceback

            conn.send(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))


class RankPool:
    """``tp`` spawned worker processes, reused across engines (vLLM is imported once each)."""

    def __init__(self, tp: int, make_rank: Any) -> None:
        ctx = mp.get_context("spawn")
        self.tp = tp
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve_rank, args=(rank, child, make_rank), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect("start")

    def _collect(self, cmd: str) -> list[Any]:
        out = []
        for conn in self.conns:
            if not conn.poll(STEP_TIMEOUT_S):
                raise AssertionError(f"worker did not answer {cmd!r} in {STEP_TIMEOUT_S} s")
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(value)
            out.append(value)
        return out

    def call(self, cmd: str, args: Any = None, per_rank: list[Any] | None = None) -> list[Any]:
        for i, conn in enumerate(self.conns):
            conn.send((cmd, per_rank[i] if per_rank is not None else args))
        return self._collect(cmd)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(("exit", None))
                if conn.poll(30):
                    conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


class PoolDriver:
    """The scheduler side's loop over a ``RankPool`` (mixed into the TP rigs).

    Needs ``pool`` (a ``RankPool``), ``scheduler`` (vLLM's) and ``step()``.
    Busy means: a request left, a job in flight on any rank, or lower-tier
    work the scheduler-side manager still waits on.
    """

    pool: RankPool
    scheduler: Any

    def step(self) -> Any:
        raise NotImplementedError

    def run(self, max_steps: int = 400) -> int:
        """Step until no request is left and no transfer is in flight; the steps taken."""
        for n in range(max_steps):
            if not self.scheduler.has_requests() and not self._busy():
                return n
            output = self.step()
            if not output.total_num_scheduled_tokens:
                # Only transfers and the lower tiers' answers can make progress.
                self.pool.call("wait")
                time.sleep(0.002)
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def _busy(self) -> bool:
        if any(s["in_flight"] for s in self.pool.call("stats")):
            return True
        return bool(has_pending_work(self.scheduler))

    def rank_stats(self) -> list[dict[str, Any]]:
        return self.pool.call("stats")

    def shutdown(self) -> None:
        self.pool.call("shutdown")
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
