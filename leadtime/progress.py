"""The progress bar of every long command: on stderr, so that stdout carries only the report (JSON included),
and gone when the work is done."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def stderr_bar() -> Progress:
    """A bar with the task's description, its count done of total and the time elapsed.

    >>> with stderr_bar() as bar:
    ...     task = bar.add_task("replaying", total=3)
    ...     bar.update(task, advance=3)
    """
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
