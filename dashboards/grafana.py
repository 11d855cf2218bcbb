"""A small builder of Grafana dashboard JSON: the dashboards are written as Python objects, their JSON is derived.

Only what these dashboards use: rows of panels (time series, stat, state timeline) laid out left to right on
Grafana's 24-column grid, Prometheus queries, a `${datasource}` variable and label-value variables ("All" =
the regex `.*`). The JSON is what Grafana 10 and 11 import (schemaVersion 39); `dashboard_json` is the only
place its shape is spelled out.

>>> panel = Panel("Up", "1 while the store answers.", "none", (Query("leadtime_store_up", "{{component}}"),))
>>> board = Dashboard("demo", "Demo", "A demo.", (Row("Health", (panel,)),))
>>> data = dashboard_json(board)
>>> [p["type"] for p in data["panels"]], data["panels"][1]["targets"][0]["expr"]
(['row', 'timeseries'], 'leadtime_store_up')
>>> data["templating"]["list"][0]["name"], data["panels"][1]["datasource"]["uid"]
('datasource', '${datasource}')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and how its series are named (`{{label}}` is a label's value)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A panel: what it shows (`description`, shown by Grafana on hover), its unit and its queries.

    `unit` is a Grafana unit id ("s", "percentunit", "reqps", "short", ...). `kind` "bars" is a time series drawn
    as bars (rare events), "stat" shows the last value, "state" a state timeline of 0/1 values named by `states`.
    `dashed` names series (by their legend) drawn as dashed reference lines. `main` panels are the ones
    `leadtime dashboards render` draws.
    """

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "bars", "stat", "state"] = "timeseries"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    dashed: tuple[str, ...] = ()
    states: tuple[tuple[int, str, str], ...] = ()  # (value, text, colour) for kind "state"
    main: bool = False


@dataclass(frozen=True)
class Row:
    """A titled row of panels."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A template variable listing the values of `label` on `metric`; several or All (`.*`) may be chosen."""

    name: str
    label: str
    metric: str

    @property
    def query(self) -> str:
        """Grafana's Prometheus variable query: `label_values(metric, label)`."""
        return f"label_values({self.metric}, {self.name})"


@dataclass(frozen=True)
class Dashboard:
    """A dashboard: its stable uid (the file name too), title, description, rows and template variables."""

    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...] = ()
    tags: tuple[str, ...] = field(default=("leadtime",))

    def panels(self) -> list[Panel]:
        """Every panel, row after row."""
        return [p for row in self.rows for p in row.panels]


def dashboard_json(board: Dashboard) -> dict[str, Any]:
    """The Grafana JSON model of `board` (keys in a fixed order, so the files it writes diff cleanly)."""
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row in board.rows:
        panels.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "id": next_id,
                "panels": [],
                "title": row.title,
                "type": "row",
            }
        )
        next_id += 1
        y += 1
        x, row_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            panels.append(_panel_json(panel, next_id, {"h": panel.height, "w": panel.width, "x": x, "y": y}))
            next_id += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": board.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": list(board.tags),
        "templating": {"list": [_datasource_variable(), *(_label_variable(v) for v in board.variables)]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": board.title,
        "uid": board.uid,
        "version": 1,
        "weekStart": "",
    }


def _datasource_variable() -> dict[str, Any]:
    return {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def _label_variable(v: Variable) -> dict[str, Any]:
    return {
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": dict(DATASOURCE),
        "definition": v.query,
        "hide": 0,
        "includeAll": True,
        "label": v.label,
        "multi": True,
        "name": v.name,
        "options": [],
        "query": {"qryType": 1, "query": v.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def _panel_json(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    overrides: list[dict[str, Any]] = []
    options: dict[str, Any]
    legend = {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True}
    tooltip = {"mode": "multi", "sort": "desc"}
    instant = panel.kind == "stat"
    if panel.kind in ("timeseries", "bars"):
        panel_type = "timeseries"
        defaults["color"] = {"mode": "palette-classic"}
        defaults["custom"] = {
            "drawStyle": "bars" if panel.kind == "bars" else "line",
            "fillOpacity": 60 if panel.kind == "bars" else 10,
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
        }
        options = {"legend": legend, "tooltip": tooltip}
        for name in panel.dashed:
            overrides.append(
                {
                    "matcher": {"id": "byName", "options": name},
                    "properties": [
                        {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                        {"id": "custom.fillOpacity", "value": 0},
                        {"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}},
                    ],
                }
            )
    elif panel.kind == "stat":
        panel_type = "stat"
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "blue", "value": None}]}
        options = {
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        }
    else:
        panel_type = "state-timeline"
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "text", "value": None}]}
        states = {
            str(value): {"color": colour, "index": i, "text": text}
            for i, (value, text, colour) in enumerate(panel.states)
        }
        defaults["mappings"] = [{"options": states, "type": "value"}]
        options = {
            "alignValue": "left",
            "legend": legend,
            "mergeValues": True,
            "rowHeight": 0.9,
            "showValue": "auto",
            "tooltip": tooltip,
        }
    targets = [
        {
            "datasource": dict(DATASOURCE),
            "editorMode": "code",
            "expr": q.expr,
            "instant": instant,
            "legendFormat": q.legend or "__auto",
            "range": not instant,
            "refId": chr(ord("A") + i),
        }
        for i, q in enumerate(panel.queries)
    ]
    return {
        "datasource": dict(DATASOURCE),
        "description": panel.description,
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "gridPos": grid,
        "id": panel_id,
        "options": options,
        "targets": targets,
        "title": panel.title,
        "type": panel_type,
    }
