"""``kvoffload bench transfer --against REV``: this copy path and REV's, interleaved.

A regression of a fifth hides in run-to-run noise on a shared machine (the
same code measured 0.48-0.64 of a bulk copy in three runs), so revisions are
compared inside one run: each revision's ``src/`` (REV's from ``git archive``,
this one's from the running package) is measured by its own child process
(``child.py``), and the parent asks them in turn, one round of each size at a
time, in a rotating order. Every round times store, load and the two bulk
copies back to back inside one child, so each ratio to a bulk copy compares
copies made under the same load; the table gives the median and range of
those per-round ratios for every revision side by side, and this revision's
median over each other revision's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from kvoffload.transfer import LAYOUT_KINDS, format_bytes

THIS = "this"
_CHILD = Path(__file__).with_name("child.py")
# All children's tiers together stay within this share of the available memory,
# and each tier within _TIER_CAP: a ratio to a bulk copy of the same bytes needs
# no more (the machine is shared, and every revision holds two tiers at once).
_MEMORY_SHARE = 0.5
_TIER_CAP = 512 << 20


def this_source() -> Path:
    """The ``src`` folder the running kvoffload is imported from."""
    import kvoffload

    return Path(kvoffload.__file__).resolve().parents[1]


def export_source(rev: str, into: Path) -> Path:
    """REV's ``src/`` tree, extracted under ``into`` (``git archive``; no worktree is made)."""
    repo = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"],
        cwd=this_source(),
        capture_output=True,
        text=True,
        check=False,
    )
    if repo.returncode != 0:
        raise ValueError(
            f"--against needs kvoffload run from a git checkout: {repo.stderr.strip()}"
        )
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "src"],
        cwd=repo.stdout.strip(),
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise ValueError(f"--against {rev}: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


class Child:
    """A measuring child process over one revision's source tree."""

    def __init__(self, name: str, src: Path) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(src))
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(_CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return self.proc.stdin, self.proc.stdout

    def measure(self, setup: dict[str, Any]) -> list[float]:
        """One round's [store, load, bulk, bulk_load] seconds for ``setup``."""
        stdin, stdout = self._pipes()
        stdin.write(json.dumps({"setup": setup, "rounds": 1}) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"revision {self.name}: the measuring process exited")
        times: list[float] = json.loads(line)["times"][0]
        return times

    def close(self) -> None:
        if self.proc.poll() is None:
            stdin, _ = self._pipes()
            stdin.write(json.dumps({"quit": True}) + "\n")
            stdin.close()
            self.proc.wait(timeout=60)


def _summary(rounds: list[list[float]], nbytes: int) -> dict[str, Any]:
    store = [r[2] / r[0] for r in rounds]
    load = [r[3] / r[1] for r in rounds]
    med = [statistics.median(r[i] for r in rounds) for i in range(4)]
    return {
        "store_ratio": statistics.median(store),
        "store_ratio_range": [min(store), max(store)],
        "load_ratio": statistics.median(load),
        "load_ratio_range": [min(load), max(load)],
        "store_gbps": nbytes / med[0] / 1e9,
        "load_gbps": nbytes / med[1] / 1e9,
        "bulk_gbps": nbytes / med[2] / 1e9,
        "rounds": len(rounds),
    }


def _setups(
    args: argparse.Namespace, sizes: list[int], kinds: list[str], per_tier: int
) -> list[tuple[str, int, dict[str, Any]]]:
    from kvoffload.bench.transfer.bandwidth import _geometry, _pool_sizes

    out = []
    for kind in kinds:
        for size in sizes:
            geometry = _geometry(size, args)
            pool, n = _pool_sizes(size, args, max(per_tier, 2 * size))
            setup = {
                "layers": args.layers,
                "kv_heads": args.kv_heads,
                "head_size": args.head_size,
                "block_tokens": geometry.block_size,
                "dtype": args.dtype,
                "layout": kind,
                "pool": pool,
                "n": n,
                "threads": args.threads,
                "seed": args.seed,
                "pattern": args.pattern,
            }
            out.append((kind, size, setup))
    return out


def compare(
    args: argparse.Namespace, sizes: list[int], progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Measure this revision and every ``--against`` one, interleaved; the report."""
    from kvoffload.bench.transfer.bandwidth import _available_memory

    revs = [r.strip() for r in args.against.split(",") if r.strip()]
    kinds = list(LAYOUT_KINDS) if args.layout == "all" else [args.layout]
    names = [THIS, *revs]
    avail = _available_memory() or (8 << 30)
    per_tier = min(int(avail * _MEMORY_SHARE) // (2 * len(names)), _TIER_CAP)
    tmp = Path(tempfile.mkdtemp(prefix="kvoffload-against-"))
    children: list[Child] = []
    results = []
    try:
        sources = [this_source()] + [export_source(r, tmp / f"rev{i}") for i, r in enumerate(revs)]
        children = [Child(name, src) for name, src in zip(names, sources)]
        for kind, size, setup in _setups(args, sizes, kinds, per_tier):
            rounds: dict[str, list[list[float]]] = {c.name: [] for c in children}
            for k in range(args.rounds):
                for child in children[k % len(children) :] + children[: k % len(children)]:
                    rounds[child.name].append(child.measure(setup))
                if progress is not None:
                    progress(1)
            nbytes = setup["n"] * size
            row = {
                "layout": kind,
                "block_bytes": size,
                "blocks": setup["n"],
                "revisions": {name: _summary(rounds[name], nbytes) for name in names},
            }
            this = row["revisions"][THIS]
            row["this_over"] = {
                rev: {
                    "store": this["store_ratio"] / row["revisions"][rev]["store_ratio"],
                    "load": this["load_ratio"] / row["revisions"][rev]["load_ratio"],
                }
                for rev in revs
            }
            results.append(row)
    finally:
        for child in children:
            child.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"against": revs, "pattern": args.pattern, "rounds": args.rounds, "results": results}


def _cell(summary: dict[str, Any], side: str) -> str:
    lo, hi = summary[f"{side}_ratio_range"]
    return f"{summary[f'{side}_ratio']:.2f} ({lo:.2f}-{hi:.2f})"


def run_against(args: argparse.Namespace, sizes: list[int], kinds: list[str]) -> int:
    """The ``--against`` command: progress bar, then the JSON or the table."""
    from rich.table import Table

    from kvoffload.bench.console import console, progress_bar

    total = len(sizes) * len(kinds) * args.rounds
    with progress_bar("transfer --against", total) as advance:
        report = compare(args, sizes, progress=advance)
    if args.json:
        print(json.dumps(report))
        return 0
    names = [THIS, *report["against"]]
    table = Table(
        title=f"store / load as a fraction of one bulk copy: median (range) of {args.rounds} "
        f"interleaved rounds, {args.pattern} block ids",
        caption="each revision's own src/ in its own process, asked in turn; "
        "x = this revision's median over the other's",
    )
    table.add_column("layout")
    table.add_column("block", justify="right")
    for name in names:
        table.add_column(f"{name} store", justify="right")
        table.add_column(f"{name} load", justify="right")
    for rev in report["against"]:
        table.add_column(f"x {rev}", justify="right")
    for row in report["results"]:
        cells = [row["layout"], format_bytes(row["block_bytes"])]
        for name in names:
            s = row["revisions"][name]
            cells += [_cell(s, "store"), _cell(s, "load")]
        for rev in report["against"]:
            x = row["this_over"][rev]
            cells.append(f"{x['store']:.2f} / {x['load']:.2f}")
        table.add_row(*cells)
    console(160).print(table)
    return 0
