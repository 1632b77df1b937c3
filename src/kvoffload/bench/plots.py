"""Plots are an optional extra: matplotlib comes with ``pip install 'kvoffload[plots]'``.

A command that plots calls :func:`require` before its work starts, so that a
missing matplotlib costs one line (``kvoffload: error: kvoffload bench serve
needs matplotlib: pip install 'kvoffload[plots]'``), not a long run that fails at
its end; :func:`pyplot` is matplotlib's pyplot on the file-only Agg backend.
"""

from __future__ import annotations

from typing import Any

INSTALL = "pip install 'kvoffload[plots]'"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed: the message names the command and the extra."""


def require(command: str) -> None:
    """Raise :class:`PlotsUnavailable` naming ``command`` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotsUnavailable(f"{command} needs matplotlib: {INSTALL}") from exc


def pyplot(command: str) -> Any:
    """``matplotlib.pyplot`` drawing to files only (Agg), or :class:`PlotsUnavailable`."""
    require(command)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
