"""Finding a process's children through /proc, for tests that stop one part of a running benchmark."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def children(parent: int, matches: Callable[[Path], bool]) -> list[int]:
    """Pids of the processes whose parent is `parent` and whose /proc entry `matches` (one that vanishes while it
    is read is passed over)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent and matches(entry):
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def children_named(parent: int, name: str) -> list[int]:
    """Children of `parent` whose executable is `name`."""
    return children(parent, lambda entry: (entry / "comm").read_text().strip() == name)


def children_running(parent: int, word: str) -> list[int]:
    """Children of `parent` whose command line holds the argument `word`."""
    return children(parent, lambda entry: word.encode() in (entry / "cmdline").read_bytes().split(b"\0"))
