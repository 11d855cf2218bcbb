"""PNG pictures of the dashboards' main panels, drawn with matplotlib from a Prometheus's answers.

Grafana is not needed to see what a dashboard shows: each main panel's queries go to Prometheus's HTTP API as
range queries, with Grafana's variables replaced as Grafana would (`promql.for_prometheus`; template variables
at All), and the series are drawn one panel per subplot, named by the panel's legend format, in its unit.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from leadtime.dashboards.grafana import Dashboard, Panel
from leadtime.dashboards.promql import for_prometheus

POINTS = 240  # points per series: Grafana's default resolution for a panel of this width
DPI = 72  # of the PNG (and of the figure, so that what is measured on it is what the PNG shows)
# A panel's legend names at most this many series (then "+K more"), each in at most LABEL_CHARS characters: it is
# drawn inside the panel, and one entry per path and quantile (~50) ran over the panels below, covering titles.
LEGEND_SERIES = 8
LABEL_CHARS = 40


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or refused a query (the message says which and why)."""


@dataclass(frozen=True)
class Series:
    """One series of a query's answer: its labels and its (time, value) points; NaN where a ratio had no data."""

    labels: dict[str, str]
    times: np.ndarray
    values: np.ndarray

    @property
    def has_data(self) -> bool:
        """At least one finite value."""
        return bool(np.isfinite(self.values).any())


class PrometheusApi:
    """The few calls of Prometheus's HTTP API the dashboards need, each with a timeout."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> Any:
        try:
            reply = httpx.get(f"{self.url}{path}", params=params, timeout=self.timeout_s)  # type: ignore[arg-type]
        except httpx.HTTPError as err:
            raise PrometheusError(f"Prometheus at {self.url} cannot be reached: {err}") from None
        try:
            body = reply.json()
        except ValueError:
            raise PrometheusError(f"Prometheus at {self.url}{path} answered {reply.status_code}, not JSON") from None
        if not isinstance(body, dict) or body.get("status") not in ("success", "error"):
            raise PrometheusError(
                f"{self.url} does not answer as Prometheus's HTTP API ({path} answered {reply.status_code}): is it "
                "Prometheus's address?"
            )
        if body.get("status") != "success":
            raise PrometheusError(
                f"Prometheus at {self.url}: {body.get('errorType', reply.status_code)}: "
                f"{body.get('error', 'no error text')}"
            )
        return body["data"]

    def scrape_interval_s(self) -> float:
        """The longest scrape interval of the loaded configuration (the global one if no job sets its own)."""
        config = yaml.safe_load(self._get("/api/v1/status/config", {})["yaml"]) or {}
        intervals = [(config.get("global") or {}).get("scrape_interval", "1m")]
        intervals += [job["scrape_interval"] for job in config.get("scrape_configs") or [] if "scrape_interval" in job]
        return max(parse_duration(i) for i in intervals)

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Series]:
        """`expr` evaluated every `step_s` from `start` to `end` (seconds since the epoch): a point at every step,
        NaN where it had no value. Prometheus leaves such steps out, and a line drawn through the points it returned
        would join the last one before a gap (a service down) to the first one after, as if nothing had stopped."""
        data = self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step_s})
        times = start + step_s * np.arange(math.floor((end - start) / step_s + 1e-9) + 1)
        out = []
        for result in data["result"]:
            values = np.full(len(times), np.nan)
            for t, v in result["values"]:
                k = round((float(t) - start) / step_s)
                if 0 <= k < len(times):
                    values[k] = float(v)
            out.append(Series(result["metric"], times, values))
        return out

    def query(self, expr: str, at: float) -> list[Series]:
        """`expr` evaluated at one moment (a stat panel's instant query)."""
        data = self._get("/api/v1/query", {"query": expr, "time": at})
        if data["resultType"] == "scalar":
            t, v = data["result"]
            return [Series({}, np.array([float(t)]), np.array([float(v)]))]
        return [
            Series(r["metric"], np.array([float(r["value"][0])]), np.array([float(r["value"][1])]))
            for r in data["result"]
        ]

    def label_values(self, label: str, metric: str) -> list[str]:
        """The values `label` takes on `metric` (what a `label_values` template variable lists)."""
        values: list[str] = self._get(f"/api/v1/label/{label}/values", [("match[]", metric)])
        return values


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration such as `15s`, `1m30s` or `500ms`.

    >>> parse_duration("1m30s"), parse_duration("500ms")
    (90.0, 0.5)
    """
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def legend(template: str, labels: Mapping[str, str]) -> str:
    """A series' name from a Grafana legend format (`{{label}}` → the label's value).

    >>> legend("{{target}} p50", {"target": "ttft"}), legend("__auto", {"api": "grpc"})
    ('ttft p50', 'api=grpc')
    """
    if template in ("", "__auto"):
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


@dataclass(frozen=True)
class PanelData:
    """What a panel's queries returned over the time range: (legend, series) pairs."""

    panel: Panel
    series: list[tuple[str, Series]]

    @property
    def has_data(self) -> bool:
        """At least one series with a finite value."""
        return any(s.has_data for _, s in self.series)


def fetch_panel(api: PrometheusApi, panel: Panel, start: float, end: float, scrape_interval_s: float) -> PanelData:
    """Every query of `panel` over [start, end], as Grafana would send it (template variables at All)."""
    step = max((end - start) / POINTS, scrape_interval_s)
    found = []
    for query in panel.queries:
        expr = for_prometheus(query.expr, step, scrape_interval_s, end - start)
        for series in api.query_range(expr, start, end, step):
            found.append((legend(query.legend, series.labels), series))
    return PanelData(panel, found)


def render_dashboard(
    board: Dashboard, api: PrometheusApi, out: Path, minutes: float = 60.0, end: float | None = None
) -> tuple[Path, list[PanelData]]:
    """Draw `board`'s main panels over the last `minutes` (up to `end`, default now) into `out`/<uid>.png."""
    import matplotlib.pyplot as plt

    end = time.time() if end is None else end
    start = end - minutes * 60
    scrape = api.scrape_interval_s()
    panels = [fetch_panel(api, p, start, end, scrape) for p in board.panels() if p.main]
    moment = datetime.fromtimestamp(end).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    fig = draw_panels(f"{board.title}: main panels, {minutes:g} min to {moment}, from Prometheus", panels, start, end)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{board.uid}.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path, panels


def draw_panels(title: str, panels: Sequence[PanelData], start: float, end: float) -> Any:
    """The matplotlib figure of `panels` over [start, end] (Unix seconds), two a row (kept apart from the queries,
    so that its drawing can be checked on any data); the caller saves and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    columns = 2
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(13, 2.9 * rows + 0.6), squeeze=False, dpi=DPI)
    clock = mdates.DateFormatter("%H:%M:%S" if end - start <= 600 else "%H:%M")
    for ax, data in zip(axes.flat, panels, strict=False):
        _draw(ax, data, clock)
        # Every panel over the whole range asked for: one whose data stopped early must not look current.
        ax.set_xlim(datetime.fromtimestamp(start), datetime.fromtimestamp(end))
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _draw(ax: Any, data: PanelData, clock: Any) -> None:
    panel = data.panel
    ax.set_title(panel.title, fontsize=9)
    ax.tick_params(labelsize=7)
    scale, suffix = _unit(panel.unit, [s for _, s in data.series])
    for name, series in sorted(data.series, key=lambda item: item[0]):
        when = [datetime.fromtimestamp(t) for t in series.times]
        values = series.values * scale
        if name in panel.dashed:
            ax.plot(when, values, linestyle="--", color="red", linewidth=1, label=name)
        elif panel.kind == "bars":
            ax.step(when, values, where="mid", linewidth=1, label=name)
        else:
            ax.plot(when, values, linewidth=1, label=name)
    if panel.min is not None:
        ax.set_ylim(bottom=panel.min * scale)
    if panel.max is not None:
        ax.set_ylim(top=panel.max * scale * 1.02)
    ax.set_ylabel(suffix, fontsize=7)
    ax.xaxis.set_major_formatter(clock)
    ax.grid(alpha=0.3)
    if data.series:
        _legend(ax, data)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def _legend(ax: Any, data: PanelData) -> None:
    """The panel's legend, bounded so that it stays inside the panel: the dashed reference lines and the series
    that peak highest (what the eye finds first) up to `LEGEND_SERIES`, in drawing order, then "+K more"."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    peaks = {name: float(np.nanmax(s.values)) if s.has_data else -math.inf for name, s in data.series}
    if len(handles) > LEGEND_SERIES:
        ranked = sorted(range(len(labels)), key=lambda i: (labels[i] not in data.panel.dashed, -peaks[labels[i]]))
        kept = sorted(ranked[:LEGEND_SERIES])
        more = Line2D([], [], linestyle="none", label=f"+{len(handles) - len(kept)} more")
        handles, labels = [handles[i] for i in kept] + [more], [labels[i] for i in kept] + [more.get_label()]
    shown = [shorten(name) for name in labels]
    ax.legend(handles, shown, fontsize=6, loc="upper left", ncol=2 if len(shown) > 4 else 1, framealpha=0.6)


def shorten(name: str, chars: int = LABEL_CHARS) -> str:
    """`name` in at most `chars` characters, cut in the middle: a series' name ends in what tells it from its
    neighbours (a route's last part, the quantile).

    >>> shorten("/v1/models/qwen3-32b/completions/stream p99", 30)
    '/v1/model…mpletions/stream p99'
    """
    if len(name) <= chars:
        return name
    head = (chars - 1) // 3
    return name[:head] + "…" + name[len(name) - (chars - 1 - head) :]


def _unit(unit: str, series: Sequence[Series]) -> tuple[float, str]:
    """A scale and axis label for a Grafana unit: percentunit in %, seconds in ms when small."""
    if unit == "percentunit":
        return 100.0, "%"
    if unit == "s":
        finite = [float(np.nanmax(s.values)) for s in series if s.has_data]
        return (1000.0, "ms") if finite and max(finite) < 1.0 else (1.0, "s")
    return 1.0, {"ops": "per second", "reqps": "requests/s"}.get(unit, "")
