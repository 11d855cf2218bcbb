"""Time order and the time-ordered splits of the retraining job: train on the past, judge on the most recent.

A model that serves tomorrow is judged on what came last, never on rows drawn at random from the whole history
(neighbouring rows of one burst would then sit on both sides and flatter it). So the rows are put in time order,
the most recent share becomes the evaluation slice on which champion and challenger are compared, and the
hyper-parameter search runs scikit-learn's `TimeSeriesSplit` folds inside the history before it (each fold fits
on a past and validates on the block right after it).

Which order the rows are in is a question of clocks. The rows' timestamps are the clocks of the routers that
sent them, which can run apart: a router an hour ahead would supply the whole evaluation slice if rows from several
were sorted by timestamp, and a year-9999 timestamp would always be judged on. The service's Redis stream is in
the order Redis took its rows, the one order no router's clock can upset. A file's lines are in whatever order it
was exported in (newest first, shuffled), so one file alone is put in the order of its timestamps: one file is one
log, and its line order no arrival order (ties keep their line order).

Otherwise timestamps only merge sources, and only when they agree with arrival order: every row has one, none is
more than `AGREEMENT_S` ahead of this host's clock, and in no source does a row's timestamp fall more than
`AGREEMENT_S` behind one that arrived before it (clocks a little apart and requests of different lengths stay
within that). Each source then keeps its own order, placed among the others by the latest timestamp seen in it so
far. Otherwise the order is the order the rows were read in, sources in the order given, and the split says why;
when the evaluation slice that results starts more than `AGREEMENT_S` before the history's latest timestamp
(`evaluation_overlap_s`), the job warns that it is not the most recent rows by their timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.model_selection import TimeSeriesSplit

BY_TIMESTAMP = "timestamp"
BY_ARRIVAL_MERGED = "arrival order, sources merged by timestamp"
"""Each source in its own order, placed among the others by its latest timestamp so far: not a sort by timestamp
(a row up to `AGREEMENT_S` behind an earlier one keeps its place), and the label says so."""
BY_READ_ORDER = "read order"
NO_TIMESTAMP = "not every row has a timestamp"  # why the order is read order, when it is that
AGREEMENT_S = 300.0
"""How far a row's timestamp may fall behind one that arrived before it in its source, or run ahead of this host's
clock, for the timestamps to be taken as agreeing with arrival order."""


def time_order(
    timestamps: np.ndarray,
    source: np.ndarray | None = None,
    names: Sequence[str] = (),
    now: float | None = None,
    streams: Sequence[bool] = (),
) -> tuple[np.ndarray, str, str]:
    """Row indices in time order, what the order rests on (`BY_TIMESTAMP`, `BY_ARRIVAL_MERGED` or `BY_READ_ORDER`)
    and, for read order, why the timestamps were not used. `source`: each row's source (one source if None),
    `names` theirs, `streams` whether each is a stream in the order it received its rows (a file if not given);
    `now`: this host's clock (time.time() if None).

    >>> order, basis, why = time_order(np.array([1.0, 3.0, 2.0, 4.0]), np.array([0, 0, 1, 1]), now=10.0)
    >>> order.tolist(), basis
    ([0, 2, 1, 3], 'arrival order, sources merged by timestamp')
    >>> time_order(np.array([3.0, np.nan]))[1:]
    ('read order', 'not every row has a timestamp')
    """
    n = len(timestamps)
    read_order = np.arange(n)
    if not n or not np.isfinite(timestamps).all():
        return read_order, BY_READ_ORDER, NO_TIMESTAMP
    now = time.time() if now is None else now
    ahead = float(timestamps.max()) - now
    if ahead > AGREEMENT_S:
        return read_order, BY_READ_ORDER, f"a timestamp is {ahead:.0f} s ahead of this host's clock"
    source = np.zeros(n, dtype=np.intp) if source is None else np.asarray(source)
    present = np.unique(source)
    if len(present) == 1 and not (present[0] < len(streams) and streams[present[0]]):
        return np.argsort(timestamps, kind="stable"), BY_TIMESTAMP, ""  # one file: one log, in any line order
    latest = np.empty(n)  # per row, the latest timestamp of its source up to it, in arrival order
    for index in present:
        rows = np.flatnonzero(source == index)
        latest[rows] = np.maximum.accumulate(timestamps[rows])
        back = float((latest[rows] - timestamps[rows]).max())
        if back > AGREEMENT_S:
            name = names[index] if index < len(names) else f"source {index + 1}"
            return (
                read_order,
                BY_READ_ORDER,
                f"in {name} a timestamp goes {back:.0f} s back against the order the rows arrived in "
                "(clocks that disagree)",
            )
    return np.argsort(latest, kind="stable"), BY_ARRIVAL_MERGED, ""


@dataclass(frozen=True)
class TimeSplit:
    """Row indices (into the rows as read) of the history, oldest first, and of the evaluation slice after it;
    what the order rests on and, for read order, why."""

    history: np.ndarray
    evaluation: np.ndarray
    basis: str
    reason: str = ""


def split_recent(
    timestamps: np.ndarray,
    eval_share: float,
    source: np.ndarray | None = None,
    names: Sequence[str] = (),
    now: float | None = None,
    streams: Sequence[bool] = (),
) -> TimeSplit:
    """The most recent `eval_share` of the rows (at least one) as the evaluation slice, the rest as history
    (`time_order` takes the other arguments).

    >>> s = split_recent(np.array([1.0, 2.0, 3.0, 5.0, 4.0]), 0.4, np.array([0, 0, 0, 0, 1]), now=10.0)
    >>> s.history.tolist(), s.evaluation.tolist()
    ([0, 1, 2], [4, 3])
    """
    if not 0.0 < eval_share < 1.0:
        raise ValueError(f"eval_share must be in (0, 1), got {eval_share}")
    order, basis, reason = time_order(timestamps, source, names, now, streams)
    n_eval = max(1, int(round(len(order) * eval_share)))
    if n_eval >= len(order):
        raise ValueError(f"{len(order)} rows cannot be split into a history and an evaluation slice")
    return TimeSplit(order[:-n_eval], order[-n_eval:], basis, reason)


def evaluation_overlap_s(timestamps: np.ndarray, split: TimeSplit) -> float | None:
    """How many seconds the evaluation slice starts before the history's latest timestamp, when that is more than
    `AGREEMENT_S` (its rows are then not the most recent by their timestamps); None otherwise, or without a
    timestamp on every row.

    >>> s = TimeSplit(np.array([0, 1]), np.array([2]), BY_READ_ORDER)
    >>> evaluation_overlap_s(np.array([0.0, 900.0, 100.0]), s), evaluation_overlap_s(np.array([0.0, 1.0, 2.0]), s)
    (800.0, None)
    """
    if not len(split.history) or not np.isfinite(timestamps).all():
        return None
    overlap = float(timestamps[split.history].max() - timestamps[split.evaluation].min())
    return overlap if overlap > AGREEMENT_S else None


def search_folds(n: int, folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`folds` (fit, validation) position pairs over `n` time-ordered rows: each fold fits on everything before
    its validation block. The last fold's validation block is the most recent one.

    >>> [(f.tolist(), v.tolist()) for f, v in search_folds(6, 2)]
    [([0, 1], [2, 3]), ([0, 1, 2, 3], [4, 5])]
    """
    if folds < 2:
        raise ValueError(f"folds must be ≥ 2, got {folds}")
    if n < 2 * (folds + 1):
        raise ValueError(f"{n} rows are too few for {folds} time-ordered folds")
    return [(fit, valid) for fit, valid in TimeSeriesSplit(n_splits=folds).split(np.empty((n, 1)))]
