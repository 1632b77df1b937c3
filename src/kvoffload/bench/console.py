"""What the benchmarks' terminal output shares: the progress bar, a wide console, tables.

rich loads on first use, so that ``kvoffload bench NAME --help`` needs none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


@contextmanager
def progress_bar(label: str, total: int, show: bool = True) -> Iterator[Callable[..., None]]:
    """A transient bar for ``total`` steps; yields ``advance(n=1, what=None)``.

    ``what`` relabels the bar (the step now running); ``advance(what)``, a name alone,
    counts the step it names. On stderr, so that ``--json`` on stdout stays one JSON
    object; ``show=False`` draws nothing.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns,
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not show,
    ) as bar:
        task = bar.add_task(label, total=total)

        def advance(n: int | str = 1, what: str | None = None) -> None:
            if isinstance(n, str):
                bar.update(task, advance=1, description=n)
            else:
                bar.update(task, advance=n, description=what or label)

        yield advance


def console(min_width: int = 0) -> Console:
    """A console at least ``min_width`` wide (piped, rich's 80 columns fold every figure)."""
    from rich.console import Console

    return Console(width=max(Console().width, min_width))


def table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    caption: str | None = None,
    left: int = 0,
) -> Table:
    """A rich table of figures: right-aligned, but for the first ``left`` columns."""
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        t.add_row(*row)
    return t


def markdown_table(columns: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]
