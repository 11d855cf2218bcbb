"""A ceiling on TTFT that the outcomes show and the features cannot: clients that give up.

A client (inference-perf, an SDK, a load balancer) drops a request still queued after its timeout, and vLLM
aborts it: nothing is recorded for it. Under a queue deeper than the timeout can drain, every recorded TTFT is
then the timeout plus the request's own prefill, a wall, while the queue the row shows keeps growing. The
physics prior predicts the time that queue takes to drain (minutes) and the learned correction, which scales the
prior, cannot turn a growing prediction into a constant; a tree on raw features, which never predicts beyond
the targets it saw, can. The timeout is nowhere in the rows.

So the wall is detected in the outcomes and the predictions are capped at it. Two tests, both over the last
`window` observations, must hold:

- a pile: at least `share` of the outcomes lie within `band` of the level, the median of the upper half of
  the outcomes (an unbounded distribution has a few percent there: an exponential's ~4%);
- evidence that the pile is a wall: of the rows whose prediction (uncapped) was above the pile, at least
  `obeyed` had their outcome in it, over at least `min_evidence` rows, and those predictions overshot their
  outcomes by more than the pile's width (twice `band`, at the median), and those outcomes do not rise with
  their predictions (log-log slope below `max_slope`). A steady load with prompts of one length also piles up,
  but there a prediction above the pile comes true; a queue that keeps growing piles up too over a window (its
  TTFT rises slowly against its level), but there the predictions follow it: only their noise lands above the
  pile, or, where the model overshoots the queue for a while, the outcomes still rise with the predictions
  (slope 0.7–0.85 at the end of sim:long-chat-no-timeout, against −0.07 to 0.04 at a 60 s timeout).

While both hold, each row's mean prediction is at most the wall as it stands for that row, and its upper quantile,
wherever it reaches the pile (up to `band` below the wall, or above), is the pile's own upper quantile there,
widened by an adaptive-conformal term that answers for the coverage of the rows capped (the pile drifts, and labels
may arrive late). Raised to it, not only capped at it: a row predicted just short of the wall is one whose request
the queue may still hold until the timeout, and such rows came out at the wall nearly every time (97% of those
predicted within 20% of it, in ten 90/10 splits of sim:long-chat), where their own upper quantile covered 77% of
them (raised, 90%). A request served at the wall waited about the timeout and then had its own prompt prefilled, so
the wall is not one level: it is fitted over the pile as `base + slope × own`, where `own` is the row's own prefill
time at the roofline (the caller's; slope ≥ 0, about 2.2 on the simulated traces, where a long document adds two
seconds to a 60 s timeout), and `base` is the median of what is left: the median, not the level that found the pile,
which is the pile's 75th percentile once the whole window is at the wall. (A client whose timeout also bounds the
prefill gives a slope near 0.) The model underneath goes on predicting the uncapped time: the learner takes an
outcome at the wall as a lower bound (one it already predicts at least is not learned), so the wall neither drags
its correction down nor hides outcomes that leave it, and the cap goes as soon as they do.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, TypeVar

import numpy as np

Values = TypeVar("Values", np.ndarray, float)


class OutcomeCeiling:
    """A wall in the recent outcomes of a target, detected and applied as a cap.

    >>> ceiling = OutcomeCeiling()
    >>> rng = np.random.default_rng(0)
    >>> own = rng.uniform(0, 1_000, 300)  # each request's own prefill time at the roofline
    >>> actual = 60_000 + 2 * own + rng.normal(0, 300, 300)  # queued up to a 60 s timeout, then prefilled
    >>> predicted = np.linspace(40_000, 120_000, 300)  # a prior that expects the queue to drain
    >>> ceiling.learn_many(actual, predicted, own)
    >>> ceiling.active, round(ceiling.slope, 1)
    (True, 2.0)

    Capped at the wall, and an upper quantile that reaches it (the second row) raised to the pile's:

    >>> mean, upper = ceiling.cap(
    ...     np.array([30_000.0, 55_000.0, 90_000.0, 90_000.0]),
    ...     np.array([45_000.0, 58_000.0, 130_000.0, 130_000.0]),
    ...     np.array([0.0, 0.0, 0.0, 1_000.0]),
    ... )
    >>> [float(round(v / 1000, 1)) for v in mean], [float(round(v / 1000, 1)) for v in upper]
    ([30.0, 55.0, 60.0, 62.0], [45.0, 60.4, 60.4, 62.4])

    Outcomes that follow the predictions are not a wall:

    >>> follows = OutcomeCeiling()
    >>> follows.learn_many(predicted * 1.02, predicted, own)
    >>> follows.active
    False
    """

    def __init__(
        self,
        window: int = 128,
        band: float = 0.05,
        share: float = 0.3,
        obeyed: float = 0.8,
        min_evidence: int = 16,
        min_level_ms: float = 1000.0,
        max_slope: float = 0.5,
        quantile: float = 0.9,
        step: float = 0.01,
        every: int = 16,
    ) -> None:
        self.window = window
        self.band = band
        self.share = share
        self.obeyed = obeyed
        self.min_evidence = min_evidence
        self.min_level_ms = min_level_ms
        self.max_slope = max_slope
        self.quantile = quantile
        self.step = step
        self.every = every
        self._unseen = 0  # outcomes since the wall was last tested
        # (actual, predicted, own) of the last `window` outcomes.
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.active = False
        self.level_ms = 0.0  # where the pile was found
        self.base_ms = 0.0  # the wall for a row with no prefill of its own
        self.slope = 0.0  # the wall's rise per ms of the row's own prefill
        self.base_upper_ms = 0.0  # the pile's upper quantile, likewise
        self.adaptive = 0.0  # log units added to the pile's quantile

    def mean_cap_ms(self, own_ms: np.ndarray | float) -> np.ndarray | float:
        """The cap on the mean of rows with this own prefill time."""
        return self.base_ms + self.slope * own_ms

    def upper_cap_ms(self, own_ms: np.ndarray | float) -> np.ndarray | float:
        """The cap on the upper quantile of rows with this own prefill time."""
        upper = (self.base_upper_ms + self.slope * own_ms) * math.exp(self.adaptive)
        return np.maximum(upper, self.mean_cap_ms(own_ms))

    def learn_many(self, actual_ms: np.ndarray, predicted_ms: np.ndarray, own_ms: np.ndarray | float = 0.0) -> None:
        """Outcomes with what the model (uncapped) predicted for them and each row's own prefill time, in order;
        re-tests the wall every `every` outcomes."""
        actual, predicted = np.asarray(actual_ms, float).tolist(), np.asarray(predicted_ms, float).tolist()
        own = np.broadcast_to(np.asarray(own_ms, float), (len(actual),)).tolist()
        if self.active:
            miss = 1.0 - self.quantile
            for a, p, o in zip(actual, predicted, own, strict=True):
                if p > self.mean_cap_ms(o):  # a row the wall capped: was its capped quantile above the outcome?
                    self.adaptive += self.step * (float(a > self.upper_cap_ms(o)) - miss)
        self._recent.extend(zip(actual, predicted, own, strict=True))
        self._unseen += len(actual)
        if self._unseen >= self.every:  # the test costs a few medians over the window: not on every outcome
            self._update()
            self._unseen = 0

    def _update(self) -> None:
        """Test the wall again over the recent outcomes, and serve what the test finds. The wall as it stood serves
        until then: a prediction on another thread meanwhile (a router predicting while it learns) is capped by it,
        not served uncapped as though no wall stood."""
        found = self._find()
        if found is None:
            self.active = False
            return
        if not self.active:
            self.adaptive = 0.0
        self.level_ms, self.slope, self.base_ms, self.base_upper_ms = found
        self.active = True

    def _find(self) -> tuple[float, float, float, float] | None:
        """The wall in the recent outcomes, (level, slope, base, base of the upper quantile), or None."""
        if len(self._recent) < 2 * self.min_evidence:
            return None
        recent = np.array(self._recent)
        actual, predicted, own = recent[:, 0], recent[:, 1], recent[:, 2]
        level = float(np.median(actual[actual >= np.median(actual)]))
        if level < self.min_level_ms:
            return None
        pile = np.abs(actual - level) <= self.band * level
        if pile.mean() < self.share:
            return None
        above = predicted > level * (1.0 + self.band)
        if above.sum() < self.min_evidence or (actual[above] <= level * (1.0 + self.band)).mean() < self.obeyed:
            return None
        if np.median(predicted[above] / actual[above]) < 1.0 + 2.0 * self.band:
            return None  # predictions that only graze the pile: a model following a slow climb, not a wall
        if _slope(np.log(predicted[above]), np.log(actual[above])) >= self.max_slope:
            return None  # outcomes that rise with the predictions: a queue the model overshoots, not a wall
        at_wall, own_at_wall = actual[pile], own[pile]
        slope = max(_slope(own_at_wall, at_wall), 0.0)
        left = at_wall - slope * own_at_wall
        return level, slope, float(np.median(left)), float(np.quantile(left, self.quantile))

    def cap(self, mean_ms: Values, upper_ms: Values, own_ms: Values | float = 0.0) -> tuple[Values, Values]:
        """(mean, upper) with the wall applied, for arrays or single values (`own_ms`: each row's own prefill
        time); the same objects when there is none."""
        if not self.active:
            return mean_ms, upper_ms
        wall = self.mean_cap_ms(own_ms)
        mean: Any = np.minimum(mean_ms, wall)  # of the caller's shape: Values
        # An upper quantile that reaches the pile (within `band` below the wall, or above) is the pile's own.
        reaches = np.asarray(upper_ms) >= np.asarray(wall) * (1.0 - self.band)
        upper: Any = np.maximum(np.where(reaches, self.upper_cap_ms(own_ms), upper_ms), mean)
        if not isinstance(upper_ms, np.ndarray):
            upper = float(upper)
        return mean, upper

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values: the recent outcomes, and the wall as it stands with the count of outcomes
        not tested yet. The wall is saved as fitted, not found again on load: found again, it would be tested over
        the untested outcomes too (up to `every` - 1 of them), and a loaded model (a restart, or the service taking
        the learner's snapshot) would serve another cap than the one saved."""
        return {
            "recent": [list(p) for p in self._recent],
            "adaptive": self.adaptive,
            "active": self.active,
            "level_ms": self.level_ms,
            "base_ms": self.base_ms,
            "slope": self.slope,
            "base_upper_ms": self.base_upper_ms,
            "unseen": self._unseen,
        }

    def load_dict(self, d: dict[str, Any]) -> None:
        """Take the state `to_dict` wrote: the wall as it was served, which goes on learning as if never saved.
        Builds before this one ignore the added keys, so the artifact version stays."""
        self._recent.clear()
        # Written before the wall depended on the row's own prefill: (actual, predicted) pairs, own 0.
        self._recent.extend((float(r[0]), float(r[1]), float(r[2]) if len(r) > 2 else 0.0) for r in d["recent"])
        if "active" in d:
            if not isinstance(d["active"], bool):
                raise ValueError(f"the wall's 'active' must be true or false, not {d['active']!r}")
            self.active = d["active"]
            self.level_ms = float(d["level_ms"])
            self.base_ms = float(d["base_ms"])
            self.slope = float(d["slope"])
            self.base_upper_ms = float(d["base_upper_ms"])
            self._unseen = int(d["unseen"])
        else:  # written before the fitted wall was saved: found again from the outcomes, as those builds did
            self._update()
            self._unseen = 0
        self.adaptive = float(d.get("adaptive", 0.0))


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of `y` on `x`; 0 where `x` does not vary."""
    spread = float(np.var(x))
    return float(np.cov(x, y, bias=True)[0, 1]) / spread if spread > 0.0 else 0.0
