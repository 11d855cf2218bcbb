"""The progress bar of every long command: on stderr, so that stdout carries only the report (JSON included),
and gone when the work is done. Drawn on a terminal only: elsewhere (a log, a pipe) it would leave a blank line
before whatever follows, an error message included."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def stderr_bar() -> Progress:
    """A bar with the task's description, its count done of total and the time elapsed (on a terminal).

    >>> with stderr_bar() as bar:
    ...     task = bar.add_task("replaying", total=3)
    ...     bar.update(task, advance=3)
    """
    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
