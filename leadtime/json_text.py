"""The JSON Leadtime's commands print (`--json`) or write (report.json): one way, so that it is always valid JSON.

A figure with nothing to measure (a percentile of no samples, a ratio over zero) is NaN or infinite in Python,
and `json.dumps` writes those as bare `NaN` / `Infinity`, which JSON does not have: a strict parser (jq, Go,
JavaScript's JSON.parse) rejects the whole report. Here they are null, and `allow_nan=False` makes any that slips
past this an error rather than invalid output.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf) as None, through dicts, lists and tuples.

    >>> finite({"a": [1.0, float("nan")], "b": {"c": float("inf")}, "d": (2, float("-inf"))})
    {'a': [1.0, None], 'b': {'c': None}, 'd': [2, None]}
    """
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(report: Any, indent: int | None = None) -> str:
    """`report` as strict JSON: non-finite figures as null.

    >>> dumps({"median": float("nan"), "n": 3})
    '{"median": null, "n": 3}'
    """
    return json.dumps(finite(report), indent=indent, allow_nan=False)


def print_json(report: Any, indent: int | None = None) -> None:
    """Print `report` as strict JSON on stdout (see `dumps`)."""
    print(dumps(report, indent))
