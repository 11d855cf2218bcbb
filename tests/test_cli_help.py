"""The CLI's help reads as a person expects: flags without a type after them."""

from __future__ import annotations

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
