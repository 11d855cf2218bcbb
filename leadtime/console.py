"""The console every report is printed on.

On a terminal it is the terminal's width. Elsewhere (a file, a pipe, a CI log) rich would take 80 columns, where
the reports' tables wrap their cells and cut their headers ("TTFT p50/p90…", "llmd_heu…"): there it is
`PIPED_WIDTH` wide.
"""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 160


def report_console() -> Console:
    """A console on stdout, `PIPED_WIDTH` wide when stdout is no terminal.

    >>> report_console().width >= 80
    True
    """
    console = Console()
    if not console.is_terminal:
        console = Console(width=PIPED_WIDTH)
    return console
