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

A class is bounded once it has outcomes of its own, by the longest wait and deepest queue learned on any class.
Bounded before that, by the other classes' queues in their milliseconds, a few requests waiting on a class slower
than any learned (an L40S serving a 70B model, where only an H100 serving an 8B one had been learned) were
deeper than any H100 queue, and that class was predicted at its own prefill plus the H100's longest wait: 0.63×
its physics prior, where every outcome learned had been 1.5× it. Once it has outcomes, its own queues and waits
raise the figures it is bounded by as any class's do. Bounded by its own figures alone, each class's evidence
grew at its share of the rows: on sim:mixed under 200-row label delay, where the queues grow stage after stage,
the bound trailed further behind them and cut the second half's TTFTs short (MAPE 0.064 against 0.036 pooled).

Both figures only ever rise: one outlier outcome (a wait far beyond the others, or a queue far deeper) raises them
for good, and the bound then holds only beyond it, or hardly at all. That is left as it is: a bound that
forgets or takes a quantile would need a history of waits, and would fall back onto queues the model
has learned and predicts on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import numpy as np

Values = TypeVar("Values", np.ndarray, float)


class ClassBound:
    """One hardware class's longest wait and deepest queue learned (ms), and how many outcomes they come from."""

    def __init__(self, longest_ms: float = 0.0, deepest_ms: float = 0.0, learned: int = 0) -> None:
        self.longest_ms = longest_ms
        self.deepest_ms = deepest_ms
        self.learned = learned

    def learn_many(self, waits: np.ndarray, queue_ms: np.ndarray) -> None:
        """Take the waits (TTFT less the part that is not queueing) and the queues ahead of outcomes."""
        self.longest_ms = max(self.longest_ms, float(np.max(waits)))
        self.deepest_ms = max(self.deepest_ms, float(np.max(queue_ms)))
        self.learned += int(waits.size)

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {"longest_ms": self.longest_ms, "deepest_ms": self.deepest_ms, "learned": self.learned}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClassBound:
        """A bound from `to_dict`'s output (one written before the deepest queue was kept bounds every queued row,
        as it did then)."""
        return cls(float(d["longest_ms"]), float(d.get("deepest_ms", 0.0)), int(d["learned"]))


class WaitBound:
    """The longest wait and deepest queue learned, and the cap they set on the mean TTFT predictions of the classes
    that have outcomes learned (kept per class: `classes`). `hw` is the class key of every row, or one for all of
    them; the default, one unnamed class, is for callers that have one.

    >>> bound, own = WaitBound(), np.array([2_000.0] * 3)
    >>> bound.cap(np.array([90_000.0]), np.array([500.0]), np.array([9e9])).tolist()  # nothing learned: no bound
    [90000.0]
    >>> # waited 20 s and 30 s behind queues the prior prices at 10 s and 15 s, on H100s
    >>> bound.learn_many(np.array([20_500.0, 31_000.0]), np.array([500.0, 1_000.0]), np.array([1e4, 1.5e4]), "h100")
    >>> bound.cap(np.array([90_000.0, 90_000.0, 5_000.0]), own, np.array([4e4, 1e4, 4e4]), "h100").tolist()
    [32000.0, 90000.0, 5000.0]
    >>> # as deep a queue on a class with nothing learned: in its own ms, not the H100s', so not bounded
    >>> bound.cap(np.array([90_000.0] * 3), own, np.array([4e4] * 3), ["l40s", "h100", "l40s"]).tolist()
    [90000.0, 32000.0, 90000.0]
    """

    def __init__(self) -> None:
        self.classes: dict[str, ClassBound] = {}

    @property
    def learned(self) -> int:
        """Outcomes learned, over every class."""
        return sum(b.learned for b in self.classes.values())

    @property
    def longest_ms(self) -> float:
        """The longest wait learned on any class: the bound of every class that has outcomes."""
        return max((b.longest_ms for b in self.classes.values()), default=0.0)

    @property
    def deepest_ms(self) -> float:
        """The deepest queue learned on any class: beyond it, a row of a class that has outcomes is bounded."""
        return max((b.deepest_ms for b in self.classes.values()), default=0.0)

    def bounds(self, key: str) -> bool:
        """Whether rows of class `key` are bounded: it has outcomes learned."""
        return key in self.classes

    def learn_many(
        self,
        actual_ms: np.ndarray,
        not_queueing_ms: np.ndarray | float,
        queue_ms: np.ndarray | float,
        hw: list[str] | str = "",
    ) -> None:
        """Take outcomes (TTFT in ms), the part of each that is not queueing (own prefill, stated waits), the
        prior's time for the queue each had ahead of it, and the class of each (`hw`)."""
        waits = np.asarray(actual_ms, dtype=np.float64) - not_queueing_ms
        if not waits.size:
            return
        queues = np.broadcast_to(np.asarray(queue_ms, dtype=np.float64), waits.shape)
        keys = _one_key(hw)
        if keys is not None:
            self._class(keys).learn_many(waits, queues)
            return
        per_row = np.array(hw, dtype=object)
        for key in dict.fromkeys(hw):
            rows = per_row == key
            self._class(key).learn_many(waits[rows], queues[rows])

    def _class(self, key: str) -> ClassBound:
        """The figures of class `key`, made if it has none. A new class makes a new dict rather than growing this
        one: a prediction on another thread may be reading the figures over every class (`longest_ms`), and a dict
        that grows under an iteration fails it ("dictionary changed size during iteration")."""
        bound = self.classes.get(key)
        if bound is None:
            bound = ClassBound()
            self.classes = {**self.classes, key: bound}
        return bound

    def cap(
        self, mean_ms: Values, not_queueing_ms: Values | float, queue_ms: Values | float, hw: list[str] | str = ""
    ) -> Values:
        """Mean predictions of rows queued deeper than any learned bounded by each row's part that is not queueing
        plus the longest wait learned; the others, and every row of a class that has learned nothing, unchanged."""
        if not self.classes:
            return mean_ms
        key = _one_key(hw)
        if key is not None and not self.bounds(key):
            return mean_ms
        deeper = np.asarray(queue_ms) > self.deepest_ms
        if key is None:
            deeper = deeper & np.array([self.bounds(k) for k in hw])
        bounded = np.minimum(mean_ms, np.asarray(not_queueing_ms) + self.longest_ms)
        return np.where(deeper, bounded, mean_ms)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {"classes": {key: bound.to_dict() for key, bound in self.classes.items()}}

    def load_dict(self, d: dict[str, Any], classes: Iterable[str] = ()) -> None:
        """Take the state `to_dict` wrote.

        One written before the figures were kept per class holds one pair learned on every class together: it is
        taken as the figures of each of `classes` (the classes the model had learned outcomes of), which it
        bounded then and go on being bounded, and not of the classes that had learned nothing, which it bounded
        with other classes' queues (they are bounded once they have outcomes of their own)."""
        if "classes" in d:
            self.classes = {str(key): ClassBound.from_dict(b) for key, b in d["classes"].items()}
            return
        old = ClassBound.from_dict(d)
        self.classes = {} if not old.learned else {key: ClassBound.from_dict(d) for key in classes}


def _one_key(hw: list[str] | str) -> str | None:
    """The one class every row has (`hw` a single key, or a list of one key), or None when they differ."""
    if isinstance(hw, str):
        return hw
    if hw and hw.count(hw[0]) == len(hw):
        return hw[0]
    return None
