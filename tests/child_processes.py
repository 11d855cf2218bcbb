"""Finding a process's children through /proc, for tests that stop one part of a running benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
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


def kill_service_expecting_one_line(benchmark: subprocess.Popen[str]) -> None:
    """Kill the service a running benchmark started (SIGKILL) and check the benchmark says so in one `error:` line,
    exit status 2, nothing on stdout."""
    (service,) = children_running(benchmark.pid, "serve")
    os.kill(service, signal.SIGKILL)
    stdout, stderr = benchmark.communicate(timeout=120)
    assert benchmark.returncode == 2, stderr[-3000:]
    assert stdout == ""
    assert stderr.strip().splitlines() == ["error: the service stopped during the run (killed by signal 9)"]
