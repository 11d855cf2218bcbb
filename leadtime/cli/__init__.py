"""The `leadtime` command: one CLI over every package. Nothing imports it but `leadtime.__main__` (and the
`leadtime` script).

One module per command or group of commands; each command imports what it needs lazily so that `leadtime --help`
stays fast. Errors a user can fix (bad file, bad option value) are printed as one line and exit 2, never as a
traceback (`common.fail`).
"""

from __future__ import annotations

import os

# gRPC's C core logs an INFO line for every connection that fails its TLS handshake (a port scanner, a client
# speaking plain text): read once, when grpc is first imported, so set before any command imports it. A user's own
# setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Importing the command modules registers their commands, in this order in `leadtime --help`.
from leadtime.cli import bench, dashboards, retrain, route, serve, sim  # noqa: F401
from leadtime.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
