"""Reading llm-d training-row JSONL files with errors that name the line."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leadtime.data import MEASURED, resolve
from leadtime.features.errors import FeatureError
from leadtime.features.rows import observation_from_llmd, parse_timestamp

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
    return load_llmd_lines(path)[0]


def load_llmd_lines(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(every row validated as an llm-d training entry, the line number of each), so that what a later step finds
    wrong with `rows[i]` can be told at its line (`at_line`); a bad line raises FeatureError naming it."""
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
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
            lines.append(lineno)
    if not rows:
        raise FeatureError(str(path), "holds no rows")
    return rows, lines


_ROW_INDEX = re.compile(r"rows\[(\d+)\]\.(.*)", re.DOTALL)


def at_line(err: FeatureError, path: Path, lines: list[int]) -> FeatureError:
    """An error about `rows[i].field` of a file's rows (as `Vectorizer.batch_llmd` names them) as one about the
    file's line of row i, like every other error about a row of a file; any other error as it is."""
    match = _ROW_INDEX.fullmatch(err.field)
    if match is None or int(match[1]) >= len(lines):
        return err
    return FeatureError(f"{path}:{lines[int(match[1])]}: {match[2]}", err.problem)


@dataclass(frozen=True)
class RowUsage:
    """How many rows of a file measure each target: a row whose actual is 0 did not observe it."""

    rows: int
    ttft: int
    tpot: int
    neither: int
    both: int = 0
    """Rows that measure both targets (counted in each): llm-d's sidecar writes a TTFT row and a TPOT row apart."""
    implausible: int = 0
    """Rows Leadtime's poisoning guard does not learn (`predictor.physics.implausible`)."""
    first_implausible_line: int | None = None
    out_of_order_line: int | None = None
    """The first line whose timestamp is earlier than the row's before it: the walk follows the file's order."""

    @classmethod
    def of(cls, ttft: np.ndarray, tpot: np.ndarray) -> RowUsage:
        """From the actuals (`actuals`) of every row."""
        measured_ttft, measured_tpot = ttft > 0, tpot > 0
        neither = int((~measured_ttft & ~measured_tpot).sum())
        both = int((measured_ttft & measured_tpot).sum())
        return cls(len(ttft), int(measured_ttft.sum()), int(measured_tpot.sum()), neither, both)

    def describe(self) -> str:
        """As the report says it.

        >>> RowUsage(60, 28, 27, 5).describe()
        '60 rows: TTFT from 28, TPOT from 27, 5 with neither skipped'
        >>> RowUsage(60, 31, 30, 0, 1).describe()
        '60 rows: TTFT from 31, TPOT from 30 (1 row measures both)'
        """
        skipped = f", {self.neither} with neither skipped" if self.neither else ""
        both = f" ({self.both} row{'s' if self.both != 1 else ''} measure{'' if self.both != 1 else 's'} both)"
        return f"{self.rows} rows: TTFT from {self.ttft}, TPOT from {self.tpot}{skipped}{both if self.both else ''}"


def first_out_of_order(rows: list[dict[str, Any]]) -> int | None:
    """The index of the first row whose timestamp is earlier than the last one before it (rows without one are
    passed over), or None.

    >>> first_out_of_order([{"timestamp": 3.0}, {}, {"timestamp": 2.0}]), first_out_of_order([{"timestamp": 1}])
    (2, None)
    """
    last = -math.inf
    for i, row in enumerate(rows):
        if row.get("timestamp") is None:
            continue
        stamp = parse_timestamp(row["timestamp"])
        if stamp < last:
            return i
        last = stamp
    return None


def actuals(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(actual TTFT, actual TPOT) per row in milliseconds; 0 where a target was not observed."""
    return (
        np.array([float(r["actual_ttft_ms"]) for r in rows]),
        np.array([float(r["actual_tpot_ms"]) for r in rows]),
    )
