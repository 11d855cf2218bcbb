"""The `leadtime` command: one CLI over every package. Nothing imports it but `leadtime.__main__` (and the
`leadtime` script).

One module per command or group of commands; each command imports what it needs lazily so that `leadtime --help`
stays fast. Errors a user can fix (bad file, bad option value) are printed as one line and exit 2, never as a
traceback (`common.fail`).
"""

from __future__ import annotations

import os
import sys

import typer

# gRPC's C core logs an INFO line for every connection that fails its TLS handshake (a port scanner, a client
# speaking plain text): read once, when grpc is first imported, so set before any command imports it. A user's own
# setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Importing the command modules registers their commands, in this order in `leadtime --help`.
from leadtime.cli import bench, dashboards, retrain, route, serve, sim  # noqa: F401
from leadtime.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    """Run the CLI, saying a usage error (a value of the wrong type, an unknown or missing option) in one `error:`
    line as every other error is said, not in click's usage, hint and `Error:` lines. click's exceptions are told
    by their names and shapes: typer may carry its own copy of click."""
    try:
        code = app(standalone_mode=False)
    except Exception as err:
        kind = type(err).__name__
        if kind == "Abort":  # Ctrl-C at a prompt, or its input closed
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        if kind == "NoArgsIsHelpError":  # a bare group: its help, as before
            err.show()  # type: ignore[attr-defined]
            sys.exit(2)
        if not hasattr(err, "format_message"):  # not click's: a bug, with its traceback
            raise
        typer.secho(f"error: {err.format_message()}", fg=typer.colors.RED, err=True)
        sys.exit(int(getattr(err, "exit_code", 2)))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
