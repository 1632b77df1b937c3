"""How many threads the model's kernels use, and how they wait.

The engine's GEMMs are small (a step is a few hundred rows at most), so
each parallel region is short and the OpenMP workers spend much of a step
waiting at barriers. OpenMP's default is to *spin* while waiting: on a quiet
machine that saves a wake-up per region, but as soon as another process
keeps a core busy, a spinning worker and the engine's main thread compete
with it for the cores, every barrier waits for a descheduled thread, and a
run takes several times longer (measured: 8.5 s quiet, 60 s beside one busy
process, with 2 threads).

The policy:

- the ``kvoffload`` command sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is
  imported (``kvoffload.cli.engine_args``; a value the user set wins), so
  idle workers sleep and give their core back at once;
- the thread count stays torch's (one per core) unless
  ``EngineConfig.num_threads`` says otherwise. A program that embeds the
  engine and imported torch first keeps its own OpenMP settings; it can set
  ``OMP_WAIT_POLICY=PASSIVE`` itself, or ``num_threads=1``, which never
  waits at a barrier at all.

Results do not depend on the thread count (the model's GEMMs are
batch-invariant per call; see ``kvoffload.engine.model``), so this is a
speed choice only.
"""

from __future__ import annotations

import os

import torch

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"


def default_wait_policy_env(environ: dict[str, str] | None = None) -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose one.

    Only effective before torch is first imported (OpenMP reads it once).
    """
    env = os.environ if environ is None else environ
    env.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def apply_thread_policy(num_threads: int | None) -> int:
    """Use ``num_threads`` intra-op threads (None: leave torch's); returns the count in use."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
    return torch.get_num_threads()
