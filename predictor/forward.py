"""A serving tree's record on the rows that came after it: does it still beat the online parts alone?

A candidate tree is accepted on rows held out of its own window, spread over that window. Where latency moves
with time in ways the features do not show (a decode pool whose batches fill long after the state a row
carries was published), a tree fitted on residuals of the online parts in their current state learns which
past regimes they would now get wrong, passes on held-out rows of those same regimes, and then corrects rows
of the next regime for the wrong one: on a simulated P/D trace the mean trees raised TPOT MAPE from 0.17 to 0.29,
and its quantile trees left the busier half of its TPOT rows covered 0.80 by the p90 (0.88 with no trees).
The only fair judge of that is the rows that arrive after the swap, predicted before they were learned. So
every settled row adds its loss with and without the serving tree to that tree's record, and a tree that has
served `min_rows` rows and did worse than the online parts on them is retired; the next retrain may offer
another. A mean tree is judged by absolute percentage error (what a mean is served for), a quantile tree by
the pinball loss of its quantile (the proper score of a quantile: coverage alone rewards a bound set too high).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def percentage_errors(actual_ms: np.ndarray, predicted_ms: np.ndarray) -> np.ndarray:
    """|predicted − actual| / actual of every row: what a mean prediction is judged by.

    >>> percentage_errors(np.array([100.0, 200.0]), np.array([150.0, 200.0])).tolist()
    [0.5, 0.0]
    """
    return np.abs(predicted_ms - actual_ms) / actual_ms


def pinball_losses(actual_ms: np.ndarray, upper_ms: np.ndarray, quantile: float) -> np.ndarray:
    """The pinball loss of every row's upper-quantile prediction, on log latency (relative, as every error here).

    A miss costs `quantile` per log unit short, a cover 1 − `quantile` per log unit to spare: a p90 twice the
    actual costs 0.1 × ln 2, half of it 0.9 × ln 2.

    >>> loss = pinball_losses(np.array([100.0, 100.0]), np.array([200.0, 50.0]), 0.9)
    >>> [round(v, 3) for v in (loss / np.log(2)).tolist()]
    [0.1, 0.9]
    """
    r = np.log(actual_ms) - np.log(upper_ms)
    return np.where(r > 0.0, quantile * r, (quantile - 1.0) * r)


@dataclass
class ForwardRecord:
    """Sums of the losses, with and without the serving tree, of the rows settled since it was swapped in.

    Examples
    --------
    >>> record = ForwardRecord(min_rows=4)
    >>> actual = np.array([110.0, 120.0, 100.0, 130.0])
    >>> record.add(percentage_errors(actual, np.full(4, 165.0)), percentage_errors(actual, np.full(4, 110.0)))
    >>> record.rows, record.retire()
    (4, True)
    >>> record.reset(); record.rows, record.retire()
    (0, False)
    """

    min_rows: int = 256
    rows: int = 0
    tree_error: float = 0.0
    plain_error: float = 0.0

    def add(self, tree_loss: np.ndarray, plain_loss: np.ndarray) -> None:
        """Settled rows: the loss of what was served with the tree, and of what would have been served without
        it (the online parts with the recent residuals' median, or their conformal quantile)."""
        self.rows += len(tree_loss)
        self.tree_error += float(np.sum(tree_loss))
        self.plain_error += float(np.sum(plain_loss))

    def retire(self) -> bool:
        """True once the tree has served enough rows to judge and did worse on them than no tree."""
        return self.rows >= self.min_rows and self.tree_error > self.plain_error

    def reset(self) -> None:
        """A new tree serves: its record starts empty."""
        self.rows, self.tree_error, self.plain_error = 0, 0.0, 0.0

    def to_dict(self) -> dict[str, Any]:
        """The sums as JSON-ready values (`min_rows` is this version's setting, not state)."""
        return {"rows": self.rows, "tree_error": self.tree_error, "plain_error": self.plain_error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ForwardRecord:
        """A record from `to_dict`'s output.

        >>> ForwardRecord.from_dict(ForwardRecord(rows=3, tree_error=1.5, plain_error=1.0).to_dict())
        ForwardRecord(min_rows=256, rows=3, tree_error=1.5, plain_error=1.0)
        """
        return cls(rows=int(d["rows"]), tree_error=float(d["tree_error"]), plain_error=float(d["plain_error"]))
