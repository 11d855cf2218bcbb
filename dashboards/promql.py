"""The dashboards' PromQL as Prometheus sees it: the queries of a dashboard's JSON, Grafana's variables replaced the
way Grafana replaces them before it sends a query, and the metric names an expression reads.

Grafana sends a panel's query as a range query (an instant one for stat panels) with a step (`$__interval`) and
`$__rate_interval` = max(step + scrape interval, 4 × scrape interval). A template variable set to "All" becomes
the variable's all-value, `.*` here; a chosen value is sent as it is.

>>> for_prometheus('rate(x{a=~"$accelerator"}[$__rate_interval])', step_s=2, scrape_interval_s=1, range_s=60)
'rate(x{a=~".*"}[4000ms])'
>>> for_prometheus('x{e=~"${endpoint}"}', 15, 15, 3600, {"endpoint": "h100-0"})
'x{e=~"h100-0"}'
>>> sorted(metric_names('sum by (le) (rate(a_bucket{le="1", x=~"b_c"}[5m])) / ignoring (le) group_left b_total'))
['a_bucket', 'b_total']
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
ALL = ".*"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_KEYWORDS |= {"inf", "nan", "atan2"}


@dataclass(frozen=True)
class PanelQuery:
    """One query of a panel in a dashboard's JSON."""

    dashboard: str
    panel: str
    ref: str
    expr: str
    legend: str
    instant: bool

    @property
    def name(self) -> str:
        """`dashboard / panel / refId`: how a test or a message names the query."""
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows, also those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    """The Prometheus queries of every panel of a dashboard's JSON, in panel order."""
    return [
        PanelQuery(
            dashboard.get("uid", ""),
            panel.get("title", ""),
            target.get("refId", ""),
            target["expr"],
            target.get("legendFormat", ""),
            bool(target.get("instant")) and not target.get("range"),
        )
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def rate_interval_s(step_s: float, scrape_interval_s: float) -> float:
    """Grafana's `$__rate_interval`: at least four scrapes, and a step plus one scrape."""
    return max(step_s + scrape_interval_s, 4 * scrape_interval_s)


def duration(seconds: float) -> str:
    """A Prometheus duration in whole milliseconds (`4000ms`)."""
    return f"{max(round(seconds * 1000), 1)}ms"


def for_prometheus(
    expr: str,
    step_s: float,
    scrape_interval_s: float,
    range_s: float,
    values: Mapping[str, str] | None = None,
) -> str:
    """`expr` with Grafana's variables replaced: `$__rate_interval`, `$__interval`, `$__range` from the step, the
    scrape interval and the time range; a template variable by its value in `values`, or `.*` (All).
    Raises ValueError for a built-in variable it does not know."""
    builtins = {
        "__rate_interval": duration(rate_interval_s(step_s, scrape_interval_s)),
        "__interval": duration(step_s),
        "__range": duration(range_s),
    }
    chosen = dict(values or {})

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in builtins:
            return builtins[name]
        if name.startswith("__"):
            raise ValueError(f"Grafana variable ${name} is not supported here")
        return chosen.get(name, ALL)

    return VARIABLE.sub(replace, expr)


def variables_used(expr: str) -> set[str]:
    """Names of the variables an expression uses, built-in ones (`__rate_interval`) included."""
    return {m.group(1) or m.group(2) for m in VARIABLE.finditer(expr)}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: identifiers outside strings, label matchers, ranges and label
    lists that are neither functions (followed by a parenthesis) nor PromQL keywords."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _LABEL_LISTS.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        word = match.group(0)
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS or word.startswith("$"):
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] in ".$"):
            continue  # a number's exponent or unit, or a variable
        names.add(word)
    return names


def exposed_names(exposition: str) -> set[str]:
    """The sample names a Prometheus text exposition can carry, from its `# TYPE` lines (a family without samples
    yet, such as a labelled counter nothing has incremented, counts): counter `x` → `x_total`, histogram `x` →
    `x_bucket`, `x_count`, `x_sum`, gauge and untyped `x` → `x`.

    >>> sorted(exposed_names("# TYPE a counter\\n# TYPE b histogram\\n# TYPE c gauge\\nc 1\\n"))
    ['a_total', 'b_bucket', 'b_count', 'b_sum', 'c']
    """
    names: set[str] = set()
    for line in exposition.splitlines():
        parts = line.split()
        if len(parts) != 4 or parts[:2] != ["#", "TYPE"]:
            continue
        name, kind = parts[2], parts[3]
        if kind == "counter":
            names.add(name if name.endswith("_total") else f"{name}_total")
        elif kind in ("histogram", "summary"):
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(name)
    return names
