"""`leadtime dashboards ...`: the Grafana dashboards' JSON and panel drawings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from leadtime.cli.common import dashboards_app, fail, output_dir, positive


@dashboards_app.command("build")
def dashboards_build(
    out: Annotated[
        Path, typer.Option(help="Folder to write the JSON into (in a checkout's root: the shipped files).")
    ] = Path("dashboards"),
) -> None:
    """Write leadtime-predictor.json and leadtime-router.json from their definitions (for Grafana to import)."""
    from leadtime.dashboards.files import write_dashboards

    _write_into(out, write_dashboards)


@dashboards_app.command("provisioning")
def dashboards_provisioning(
    out: Annotated[Path, typer.Option(help="Folder to write the provisioning files into.")],
) -> None:
    """Write the Grafana provisioning files (the dashboards' folder, the Prometheus data source) and a Prometheus
    scrape configuration of the service and the gateway, for Grafana and Prometheus to load from disk."""
    from leadtime.dashboards.files import write_provisioning

    _write_into(out, write_provisioning)


def _write_into(out: Path, write: Callable[[Path], list[Path]]) -> None:
    """Run `write` into the folder `out` (made and checked first), saying each file written; a write error is one
    line, not a traceback."""
    output_dir(out)
    try:
        for path in write(out):
            typer.echo(f"wrote {path}")
    except OSError as err:
        fail(err)


@dashboards_app.command("render")
def dashboards_render(
    prometheus: Annotated[str, typer.Option(help="Prometheus that scrapes Leadtime (http://HOST:PORT).")],
    out: Annotated[Path, typer.Option(help="Folder for the PNG files (one per dashboard).")],
    minutes: Annotated[float, typer.Option(help="Time range drawn, ending now.")] = 60.0,
) -> None:
    """Draw each dashboard's main panels as a PNG from Prometheus's answers (matplotlib; no Grafana needed)."""
    from leadtime.dashboards.definitions import DASHBOARDS
    from leadtime.dashboards.render import PrometheusApi, PrometheusError, render_dashboard
    from leadtime.predictor.artifact import missing_dirs, remove_empty_dirs

    positive("--minutes", minutes)
    wrong = f"--prometheus {prometheus!r}: not an http:// or https:// URL"
    try:
        parsed = urlsplit(prometheus)
        _ = parsed.port  # raises for a port that is not a number from 0 to 65535
    except ValueError as err:  # a bracket not closed, a port out of range: said, not a traceback
        fail(f"{wrong} ({err})")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        fail(f"{wrong} (http://HOST:PORT)")
    api = PrometheusApi(prometheus)
    made = missing_dirs(out)
    output_dir(out)  # checked first: a folder that cannot be made is said before anything is asked
    try:
        api.scrape_interval_s()
    except (PrometheusError, ValueError) as err:
        remove_empty_dirs(made)  # a Prometheus that cannot be asked left the new folder behind
        fail(err)
    try:
        for board in DASHBOARDS:
            path, panels = render_dashboard(board, api, out, minutes=minutes)
            empty = [p.panel.title for p in panels if not p.has_data]
            typer.echo(f"wrote {path}" + (f" (no data: {'; '.join(empty)})" if empty else ""))
    except (PrometheusError, OSError, ValueError) as err:
        remove_empty_dirs(made)
        fail(err)
