"""No mean TTFT beyond the longest wait learned where the queue is deeper than any learned: the model does not
extrapolate a queue past its evidence.

The physics prior prices a queue by the work in it, so a queue deeper than any seen so far is predicted to take
as long as its tokens take to drain, and the learned correction scales that prediction up with it. Whether that
comes true is not in the rows: clients that give up, a server that sheds load or a scheduler that reorders can
stop the outcomes at a level the model has never been shown, and until the outcomes say so (`ceiling` finds such a
wall only from rows predicted above it that came out in it, which under delayed labels arrive hundreds of rows
late) the model extrapolates the ramp to TTFTs of minutes. Under the relative error the predictions are judged
by, an overshoot costs more than a shortfall (twice the outcome costs 1.0, half of it 0.5), and past the deepest
queue it has learned the model has no evidence of its own. So a row whose queue ahead (the prior's time for it) is
deeper than any among the outcomes learned so far has its mean TTFT at most the part of its latency that is not
queueing (its own prefill time at the roofline, plus the wait for a time-sliced accelerator to come back that the
row states) plus the longest wait (TTFT less that part) learned: a tree never predicts beyond the targets it saw,
and here neither does the mean. Rows within the queues learned are left to the model: what a class's prefill
really takes beyond its roofline counts as "wait" here, and bounded everywhere, a class slower than its roofline
had long prompts cut to the longest wait of short ones (an L40S three times slower, learned on 2,000-token prompts,
served an 8,000-token prompt at half its TTFT with nothing queued). The bound rises with every longer wait
learned, so on a queue that keeps growing it trails the outcomes by the label delay. The upper quantile is not
bounded: the chance of a longer wait than any seen is what it is for.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

Values = TypeVar("Values", np.ndarray, float)


class WaitBound:
    """The longest wait and the deepest queue learned, and the cap they set on mean TTFT predictions.

    >>> bound = WaitBound()
    >>> bound.cap(np.array([90_000.0]), np.array([500.0]), np.array([9e9])).tolist()  # nothing learned: no bound
    [90000.0]
    >>> # waited 20 s and 30 s behind queues the prior prices at 10 s and 15 s
    >>> bound.learn_many(np.array([20_500.0, 31_000.0]), np.array([500.0, 1_000.0]), np.array([1e4, 1.5e4]))
    >>> bound.cap(np.array([90_000.0, 90_000.0, 5_000.0]), np.array([2_000.0] * 3), np.array([4e4, 1e4, 4e4])).tolist()
    [32000.0, 90000.0, 5000.0]
    """

    def __init__(self) -> None:
        self.longest_ms = 0.0
        self.deepest_ms = 0.0
        self.learned = 0

    def learn_many(
        self, actual_ms: np.ndarray, not_queueing_ms: np.ndarray | float, queue_ms: np.ndarray | float
    ) -> None:
        """Take outcomes (TTFT in ms), the part of each that is not queueing (own prefill, stated waits) and the
        prior's time for the queue each had ahead of it."""
        waits = np.asarray(actual_ms, dtype=np.float64) - not_queueing_ms
        if waits.size:
            self.longest_ms = max(self.longest_ms, float(np.max(waits)))
            self.deepest_ms = max(self.deepest_ms, float(np.max(queue_ms)))
            self.learned += int(waits.size)

    def cap(self, mean_ms: Values, not_queueing_ms: Values | float, queue_ms: Values | float) -> Values:
        """Mean predictions of rows queued deeper than any learned bounded by each row's part that is not queueing
        plus the longest wait; the others, and all before anything is learned, unchanged."""
        if not self.learned:
            return mean_ms
        bounded = np.minimum(mean_ms, np.asarray(not_queueing_ms) + self.longest_ms)
        return np.where(np.asarray(queue_ms) > self.deepest_ms, bounded, mean_ms)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {"longest_ms": self.longest_ms, "deepest_ms": self.deepest_ms, "learned": self.learned}

    def load_dict(self, d: dict[str, Any]) -> None:
        """Take the state `to_dict` wrote (one written before the deepest queue was kept bounds every queued row,
        as it did then, until a row is learned)."""
        self.longest_ms = float(d["longest_ms"])
        self.deepest_ms = float(d.get("deepest_ms", 0.0))
        self.learned = int(d["learned"])
