"""A serving mean tree's record on the rows that came after it: does it still beat the online parts alone?

A candidate tree is accepted on rows held out of its own window, spread over that window. Where latency moves
with time in ways the features do not show (a decode pool whose batches fill long after the state a row
carries was published), a tree fitted on residuals of the online parts in their current state learns which
past regimes they would now get wrong, passes on held-out rows of those same regimes, and then corrects rows
of the next regime for the wrong one: on a simulated P/D trace the trees raised TPOT MAPE from 0.17 to 0.29.
The only fair judge of that is the rows that arrive after the swap, predicted before they were learned. So
every settled row adds both errors to the record, and a tree that has served `min_rows` rows and does worse
than the online parts on them is retired; the next retrain may offer another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ForwardRecord:
    """Sums of absolute percentage errors, with and without the serving mean tree, since it was swapped in.

    Examples
    --------
    >>> record = ForwardRecord(min_rows=4)
    >>> actual = np.array([110.0, 120.0, 100.0, 130.0])
    >>> record.add(actual, tree_ms=np.full(4, 165.0), plain_ms=np.full(4, 110.0))
    >>> record.rows, record.retire()
    (4, True)
    >>> record.reset(); record.rows, record.retire()
    (0, False)
    """

    min_rows: int = 256
    rows: int = 0
    tree_error: float = 0.0
    plain_error: float = 0.0

    def add(self, actual_ms: np.ndarray, tree_ms: np.ndarray, plain_ms: np.ndarray) -> None:
        """Settled rows: what they measured, what was served with the tree, and what would have been served
        without it (the online parts and the median recent residual)."""
        self.rows += len(actual_ms)
        self.tree_error += float(np.sum(np.abs(tree_ms - actual_ms) / actual_ms))
        self.plain_error += float(np.sum(np.abs(plain_ms - actual_ms) / actual_ms))

    def retire(self) -> bool:
        """True once the tree has served enough rows to judge and did worse on them than no tree."""
        return self.rows >= self.min_rows and self.tree_error > self.plain_error

    def reset(self) -> None:
        """A new tree serves: its record starts empty."""
        self.rows, self.tree_error, self.plain_error = 0, 0.0, 0.0
