"""How many threads the model's kernels use, and how they wait.

The engine's GEMMs are small (a step is a few hundred rows at most), so
each parallel region is short and the OpenMP workers spend much of a step
waiting at barriers. OpenMP's default is to *spin* while waiting: on a quiet
machine that saves a wake-up per region, but as soon as another process
keeps a core busy, a spinning worker and the engine's main thread compete
with it for the cores, every barrier waits for a descheduled thread, and a
run takes several times longer.

The policy:

- one intra-op thread unless ``EngineConfig.num_threads`` says otherwise
  (``DEFAULT_NUM_THREADS``): a step's GEMMs are too small for a second thread
  to pay for its barriers. One thread never waits at a barrier, so a busy
  neighbour costs it one core's share and nothing more;
- the ``kvoffload`` command sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is
  imported (``kvoffload.cli.engine_args``; a value the user set wins), so that
  when a user asks for more threads, idle workers sleep and give their core
  back instead of spinning. A program that embeds the engine and imported
  torch first keeps its own OpenMP settings.

Results do not depend on the thread count (the model's GEMMs are
batch-invariant per call; see ``kvoffload.engine.model``), so this is a
speed choice only.
"""

from __future__ import annotations

import os

import torch

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"
# Measured with `kvoffload run` on a 2-core VM whose host took 13-20% of the CPU:
# 16.3-17.4 s with one thread, 35.3-38.2 s with two (three interleaved runs each);
# earlier, with two spinning threads: 8.5 s quiet, 60 s beside one busy process.
DEFAULT_NUM_THREADS = 1


def default_wait_policy_env(environ: dict[str, str] | None = None) -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose one.

    Only effective before torch is first imported (OpenMP reads it once).
    """
    env = os.environ if environ is None else environ
    env.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def apply_thread_policy(num_threads: int | None) -> int:
    """Use ``num_threads`` intra-op threads (None: ``DEFAULT_NUM_THREADS``); returns the count."""
    if num_threads is None:
        num_threads = DEFAULT_NUM_THREADS
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
