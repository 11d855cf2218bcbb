"""Time order and the time-ordered splits of the retraining job: train on the past, judge on the most recent.

A model that serves tomorrow is judged on what came last, never on rows drawn at random from the whole history
(neighbouring rows of one burst would then sit on both sides and flatter it). So the rows are put in time order,
the most recent share becomes the evaluation slice on which champion and challenger are compared, and the
hyper-parameter search runs scikit-learn's `TimeSeriesSplit` folds inside the history before it (each fold fits
on a past and validates on the block right after it).

Time order is the rows' timestamps when every row has one (a stable sort, so rows of one instant keep their read
order); otherwise it is the order the rows were read in, sources in the order given (an llm-d JSONL file or the
service's stream is already in arrival order), and the split says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.model_selection import TimeSeriesSplit

BY_TIMESTAMP = "timestamp"
BY_READ_ORDER = "read order"


def time_order(timestamps: np.ndarray) -> tuple[np.ndarray, str]:
    """Row indices in time order and what the order rests on (`BY_TIMESTAMP` or `BY_READ_ORDER`).

    >>> order, basis = time_order(np.array([3.0, 1.0, 2.0, 1.0]))
    >>> order.tolist(), basis
    ([1, 3, 2, 0], 'timestamp')
    >>> time_order(np.array([3.0, np.nan]))[1]
    'read order'
    """
    n = len(timestamps)
    if n and np.isfinite(timestamps).all():
        return np.argsort(timestamps, kind="stable"), BY_TIMESTAMP
    return np.arange(n), BY_READ_ORDER


@dataclass(frozen=True)
class TimeSplit:
    """Row indices (into the rows as read) of the history, oldest first, and of the evaluation slice after it."""

    history: np.ndarray
    evaluation: np.ndarray
    basis: str


def split_recent(timestamps: np.ndarray, eval_share: float) -> TimeSplit:
    """The most recent `eval_share` of the rows (at least one) as the evaluation slice, the rest as history.

    >>> s = split_recent(np.array([5.0, 1.0, 4.0, 2.0, 3.0]), 0.4)
    >>> s.history.tolist(), s.evaluation.tolist()
    ([1, 3, 4], [2, 0])
    """
    if not 0.0 < eval_share < 1.0:
        raise ValueError(f"eval_share must be in (0, 1), got {eval_share}")
    order, basis = time_order(timestamps)
    n_eval = max(1, int(round(len(order) * eval_share)))
    if n_eval >= len(order):
        raise ValueError(f"{len(order)} rows cannot be split into a history and an evaluation slice")
    return TimeSplit(order[:-n_eval], order[-n_eval:], basis)


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
