"""Plots are an optional extra: without matplotlib a plotting command fails in one line first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvoffload.bench import plots
from kvoffload.cli.main import main

MESSAGE = "needs matplotlib: pip install 'kvoffload[plots]'"


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as if not installed.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_require_names_the_command_and_the_extra(no_matplotlib: None) -> None:
    with pytest.raises(plots.PlotsUnavailable, match=r"kvoffload bench x needs matplotlib"):
        plots.require("kvoffload bench x")
    with pytest.raises(ImportError):
        plots.pyplot("kvoffload bench x")


def test_pyplot_draws_to_files_when_installed() -> None:
    pytest.importorskip("matplotlib")
    assert hasattr(plots.pyplot("kvoffload bench x"), "subplots")


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["bench", "offload", "--generate", "chat", "--requests", "8", "--no-vllm", "--out"],
         "kvoffload bench offload --out"),
        (["bench", "serve", "--out"], "kvoffload bench serve"),
    ],
)  # fmt: skip
def test_plotting_command_fails_in_one_line_before_its_work(
    no_matplotlib: None,
    argv: list[str],
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*argv, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"kvoffload: error: {command} {MESSAGE}\n"
    assert not (tmp_path / "out").exists()  # nothing was written: it stopped before the work
