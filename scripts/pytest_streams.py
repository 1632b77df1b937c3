"""Run the test suite as two pytest processes at once: the vLLM engine tests and the rest.

The end-to-end tests (``tests/e2e_vllm``) spend most of their time starting real
vLLM CPU engines, each pinned to one OpenMP thread, while the rest of the suite
leaves a core idle for long stretches (servers to wait for, subprocesses,
sockets). One after the other they took ~24 minutes on CI's two cores; side by
side each stream keeps a core busy. The streams share nothing but the machine:
every test picks its own free ports, temporary directories and engine ids.

The rest streams live to standard output; the engine stream's output is kept in
a file and printed after it, so the log reads as two whole pytest reports.
Exit status: 0 when both streams passed; otherwise the first failing stream's
status, where a stream that collected no tests (pytest's 5) fails with 1.

Usage: ``python scripts/pytest_streams.py [pytest args...]`` (extra arguments go
to both streams, e.g. ``-x`` or ``-k redis``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_TESTS = "tests/e2e_vllm"
#: (name, pytest arguments); the first is printed live, the others after it.
STREAMS: list[tuple[str, list[str]]] = [
    ("rest", ["tests", f"--ignore={ENGINE_TESTS}"]),
    ("engines", [ENGINE_TESTS]),
]
NO_TESTS = 5


def _verdict(name: str, rc: int, seconds: float) -> str:
    if rc == 0:
        return f"pytest stream '{name}': passed in {seconds:.0f} s"
    if rc == NO_TESTS:
        return f"pytest stream '{name}': collected no tests (exit 5): failing"
    return f"pytest stream '{name}': failed (exit {rc}) after {seconds:.0f} s"


def _start(root: Path, name: str, args: list[str], log: Path | None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "pytest", "-q", *args]
    if log is None:
        return subprocess.Popen(command, cwd=root)
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT)


def _wait_all(procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, tuple[int, float]]:
    """Each stream's exit status and the seconds it ran, in the order they ended."""
    started = time.monotonic()
    ended: dict[str, tuple[int, float]] = {}
    try:
        while len(ended) < len(procs):
            for name, proc in procs.items():
                rc = proc.poll()
                if rc is not None and name not in ended:
                    ended[name] = (rc, time.monotonic() - started)
            time.sleep(0.5)
    finally:
        # Interrupted (Ctrl-C, CI's limit): no stream outlives this process.
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
    return ended


def main(extra: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="pytest-streams-") as tmp:
        logs = {name: Path(tmp) / f"{name}.log" for name, _ in STREAMS[1:]}
        procs = {
            name: _start(root, name, [*args, *extra], logs.get(name)) for name, args in STREAMS
        }
        codes = _wait_all(procs)
        for name, log in logs.items():
            print(f"\n===== pytest stream '{name}' ({' '.join(dict(STREAMS)[name])}) =====")
            sys.stdout.write(log.read_text(errors="replace"))
    print(flush=True)
    for name, (rc, seconds) in codes.items():
        print(_verdict(name, rc, seconds), file=sys.stderr if rc else sys.stdout, flush=True)
    failing = [rc for rc, _ in codes.values() if rc != 0]
    if not failing:
        return 0
    return 1 if failing[0] == NO_TESTS else failing[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
