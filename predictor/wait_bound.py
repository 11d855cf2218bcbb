"""No mean TTFT beyond the longest wait learned: the model does not extrapolate a queue past its evidence.

The physics prior prices a queue by the work in it, so a queue deeper than any seen so far is predicted to take
as long as its tokens take to drain, and the learned correction scales that prediction up with it. Whether that
comes true is not in the rows: clients that give up, a server that sheds load or a scheduler that reorders can
stop the outcomes at a level the model has never been shown, and until the outcomes say so (`ceiling` finds such a
wall only from rows predicted above it that came out in it, which under delayed labels arrive hundreds of rows
late) the model extrapolates the ramp to TTFTs of minutes. Under the relative error the predictions are judged
by, an overshoot costs more than a shortfall (twice the outcome costs 1.0, half of it 0.5), and past the longest
wait it has learned the model has no evidence of its own. So each row's mean TTFT is at most the part of its
latency that is not queueing (its own prefill time, plus the wait for a time-sliced accelerator to come back that
the row states) plus the longest wait (TTFT less that part) among the outcomes learned so far: a tree never
predicts beyond the targets it saw, and here neither does the mean. The bound rises with every longer wait
learned, so on a queue that keeps growing it trails the outcomes by the label delay. The upper quantile is not
bounded: the chance of a longer wait than any seen is what it is for.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

Values = TypeVar("Values", np.ndarray, float)


class WaitBound:
    """The longest wait learned, and the cap it sets on mean TTFT predictions.

    >>> bound = WaitBound()
    >>> bound.cap(np.array([90_000.0]), np.array([500.0])).tolist()  # nothing learned yet: no bound
    [90000.0]
    >>> bound.learn_many(np.array([20_500.0, 31_000.0]), np.array([500.0, 1_000.0]))  # waited 20 s and 30 s
    >>> bound.cap(np.array([90_000.0, 5_000.0]), np.array([2_000.0, 500.0])).tolist()
    [32000.0, 5000.0]
    """

    def __init__(self) -> None:
        self.longest_ms = 0.0
        self.learned = 0

    def learn_many(self, actual_ms: np.ndarray, not_queueing_ms: np.ndarray | float) -> None:
        """Take outcomes (TTFT in ms) and the part of each that is not queueing (own prefill, stated waits)."""
        waits = np.asarray(actual_ms, dtype=np.float64) - not_queueing_ms
        if waits.size:
            self.longest_ms = max(self.longest_ms, float(np.max(waits)))
            self.learned += int(waits.size)

    def cap(self, mean_ms: Values, not_queueing_ms: Values | float) -> Values:
        """Mean predictions bounded by each row's part that is not queueing plus the longest wait (unchanged before
        any is learned)."""
        if not self.learned:
            return mean_ms
        return np.minimum(mean_ms, np.asarray(not_queueing_ms) + self.longest_ms)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {"longest_ms": self.longest_ms, "learned": self.learned}

    def load_dict(self, d: dict[str, Any]) -> None:
        """Take the state `to_dict` wrote."""
        self.longest_ms = float(d["longest_ms"])
        self.learned = int(d["learned"])
