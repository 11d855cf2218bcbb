"""Reading llm-d training-row JSONL files with errors that name the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from leadtime.data import MEASURED, resolve
from leadtime.features.errors import FeatureError
from leadtime.features.rows import observation_from_llmd

SIMULATED_PREFIX = "sim:"


def dataset_path(name: str) -> Path:
    """The JSONL file a dataset name means: a file, a shipped name (`sharegpt-h200`), or `sim:NAME`, a trace
    the simulator records as llm-d's sidecar would (generated on first use, then cached).

    Raises DataFileError for a file that is not there, ValueError for an unknown simulated trace.
    """
    if name.startswith(SIMULATED_PREFIX) and not Path(name).is_file():
        from leadtime.simulator.traces import trace_path

        return trace_path(name[len(SIMULATED_PREFIX) :])
    return resolve(name, MEASURED, "a JSONL file of llm-d training rows, or sim:NAME")


def load_llmd_rows(path: Path) -> list[dict[str, Any]]:
    """Every row validated as an llm-d training entry; a bad line raises FeatureError naming it."""
    rows: list[dict[str, Any]] = []
    from leadtime.simulator.workload import loads_line

    with Path(path).open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = loads_line(line)
            except ValueError as err:
                raise FeatureError(f"{path}:{lineno}", f"not JSON ({err})") from None
            try:
                observation_from_llmd(row)
            except FeatureError as err:
                raise FeatureError(f"{path}:{lineno}: {err.field}", err.problem) from None
            rows.append(row)
    if not rows:
        raise FeatureError(str(path), "holds no rows")
    return rows


def actuals(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(actual TTFT, actual TPOT) per row in milliseconds; 0 where a target was not observed."""
    return (
        np.array([float(r["actual_ttft_ms"]) for r in rows]),
        np.array([float(r["actual_tpot_ms"]) for r in rows]),
    )
