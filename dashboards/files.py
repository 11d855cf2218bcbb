"""The dashboards' JSON files: where they live, how they are written from the definitions, how they are read.

>>> [p.name for p in dashboard_files()]
['leadtime-predictor.json', 'leadtime-router.json']
>>> load_dashboards()["leadtime-router"]["title"]
'Leadtime router'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leadtime.dashboards.definitions import DASHBOARDS
from leadtime.dashboards.grafana import Dashboard, dashboard_json

FOLDER = Path(__file__).resolve().parent


def dashboard_text(board: Dashboard) -> str:
    """The JSON file of a dashboard, as `write_dashboards` writes it (2-space indent, UTF-8, final newline)."""
    return json.dumps(dashboard_json(board), indent=2, ensure_ascii=False) + "\n"


def dashboard_files(folder: Path = FOLDER) -> list[Path]:
    """The file of each dashboard in `folder`, named after its uid."""
    return [folder / f"{board.uid}.json" for board in DASHBOARDS]


def write_dashboards(folder: Path = FOLDER) -> list[Path]:
    """Write every dashboard's JSON into `folder` (created if missing); return the files."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = dashboard_files(folder)
    for board, path in zip(DASHBOARDS, paths, strict=True):
        path.write_text(dashboard_text(board), encoding="utf-8")
    return paths


def write_provisioning(folder: Path) -> list[Path]:
    """Copy the shipped provisioning files (`provisioning/` here, in their layout) into `folder`; return them."""
    shipped = FOLDER / "provisioning"
    written = []
    for source in sorted(p for p in shipped.rglob("*") if p.is_file()):
        target = folder / source.relative_to(shipped)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        written.append(target)
    return written


def load_dashboards(folder: Path = FOLDER) -> dict[str, dict[str, Any]]:
    """uid → the dashboard JSON as shipped in `folder`."""
    out: dict[str, dict[str, Any]] = {}
    for path in dashboard_files(folder):
        data = json.loads(path.read_text(encoding="utf-8"))
        out[data["uid"]] = data
    return out
