"""The CLI's help reads as a person expects: flags without a type after them."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import typer
from typer.testing import CliRunner

from leadtime.cli import app


def commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under a group (typer's groups are click-like: they have `commands`)."""
    found = [prefix]
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            found += commands(command, (*prefix, name))
        else:
            found.append((*prefix, name))
    return found


def test_no_help_page_shows_a_type_after_a_flag() -> None:
    # Regression: typer's rich help printed `<bool>` after --json, --quick, --help and --version.
    root = typer.main.get_command(app)
    runner = CliRunner()
    pages = commands(root)
    assert ("bench", "accuracy") in pages and ("simulate",) in pages
    for page in pages:
        result = runner.invoke(app, [*page, "--help"])
        assert result.exit_code == 0, (page, result.output)
        assert "<bool>" not in result.output, (page, result.output)
        assert "--help" in result.output


def test_version_prints_the_installed_version() -> None:
    import leadtime

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"leadtime {leadtime.__version__}\n"


def _leadtime(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "leadtime", *args], capture_output=True, text=True, timeout=120)


def test_a_usage_error_is_one_error_line_as_every_other_error() -> None:
    """click's usage errors (a value of the wrong type, an unknown or missing option) printed `Usage:`, a hint and
    `Error:` on four lines, where every other error is one `error:` line: a script grepping for it missed them."""
    for args in (["simulate", "--fleet", "homogeneous", "--seed", "1.5"], ["simulate", "--nosuch"], ["simulate"]):
        done = _leadtime(*args)
        assert done.returncode == 2 and done.stdout == "", done
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    seed = _leadtime("simulate", "--fleet", "homogeneous", "--seed", "1.5")
    assert "--seed" in seed.stderr
    assert "--fleet" in _leadtime("simulate").stderr  # the missing option is named


def test_help_a_bare_group_and_a_refused_value_keep_their_exits() -> None:
    assert _leadtime("--help").returncode == 0
    bare = _leadtime("bench")
    assert bare.returncode == 2 and "leadtime bench [OPTIONS] COMMAND" in bare.stderr  # its help, as before
    refused = _leadtime("simulate", "--fleet", "homogeneous", "--seed", "-1")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --seed"), refused.stderr
