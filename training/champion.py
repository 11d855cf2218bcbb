"""Champion and challenger on the same recent slice: how each predicts it, and whether the challenger wins.

Both models predict the evaluation slice through `OnlinePredictor.predict_many`, exactly as the service would
serve them, with neither learning from the slice while it is predicted. Per target (and broken down per
accelerator class and role, the labels of the service's live-error metrics) the figures are the MAPE and median
APE of the mean prediction, the pinball loss of the upper quantile on log latencies (scale-free, as the trees
learn it) and the upper quantile's coverage.

The challenger wins a target when its MAPE is at least `margin` (relative) below the champion's *and* its
quantile loss is no higher: the router decides on the p90, so a better mean bought with a worse quantile is not
better. It is published only if it wins every target it can be judged on, and, with a margin of 0, only if it is
better somewhere (not the champion's equal on all of them); with no champion it is published as it is. A target
no row of the evaluation slice observed (TPOT, on a prefill-only pool) is left out of the decision, since neither
model can be judged on it; at least one target must be judged. A target the job fitted no new trees for (too few
rows, or none beat the champion's) is served by the challenger as the champion serves it: it cannot be better by
the margin, so it need only be no worse, and the challenger is published on the targets it has new trees for.
Likewise the margin applies to what changed: a target with a new upper-quantile tree but the champion's mean tree
has the champion's own MAPE, so its MAPE is held to no worse while its quantile loss answers to the usual rule.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.metrics import mean_absolute_percentage_error, mean_pinball_loss

from leadtime.features.vectorize import FeatureBatch
from leadtime.predictor.learner import OnlinePredictor
from leadtime.predictor.physics import TARGETS
from leadtime.training.limits import MARGIN


@dataclass(frozen=True)
class Scores:
    """Accuracy of one model on one target over some rows."""

    rows: int
    mape: float
    median_ape: float
    pinball: float  # on log latencies, at the served quantile
    coverage: float  # share of actuals at or below the upper quantile

    @classmethod
    def of(cls, actual: np.ndarray, mean: np.ndarray, upper: np.ndarray, quantile: float) -> Scores:
        """Scores of predictions against actuals (all > 0).

        >>> s = Scores.of(np.array([10.0, 20.0]), np.array([11.0, 18.0]), np.array([12.0, 19.0]), 0.9)
        >>> round(s.mape, 3), s.coverage
        (0.1, 0.5)
        """
        if not len(actual):
            return cls(0, float("nan"), float("nan"), float("nan"), float("nan"))
        ape = np.abs(mean - actual) / actual
        log_upper = np.log(np.maximum(upper, 1e-9))
        return cls(
            rows=len(actual),
            mape=float(mean_absolute_percentage_error(actual, mean)),
            median_ape=float(np.median(ape)),
            pinball=float(mean_pinball_loss(np.log(actual), log_upper, alpha=quantile)),
            coverage=float(np.mean(actual <= upper)),
        )

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready."""
        return {
            "rows": self.rows,
            "mape": self.mape,
            "median_ape": self.median_ape,
            "pinball": self.pinball,
            "coverage": self.coverage,
        }


@dataclass
class Evaluation:
    """One model on the evaluation slice: scores per target, per (accelerator, role) group, and the predictions."""

    overall: dict[str, Scores]
    groups: dict[str, dict[str, Scores]]  # target → "accelerator/role" → scores
    predictions: dict[str, dict[str, np.ndarray]] = field(repr=False)  # target → actual / mean / upper

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (without the predictions)."""
        return {
            t: {
                **self.overall[t].as_dict(),
                "by_group": {g: s.as_dict() for g, s in sorted(self.groups[t].items())},
            }
            for t in self.overall
        }


def group_labels(batch: FeatureBatch) -> list[str]:
    """Every row's accelerator class and role, as the service's metrics label them (``h100-sxm/prefill``)."""
    return [f"{a}/{r}" for a, r in zip(batch.accelerators, batch.roles, strict=True)]


def evaluate(
    predictor: OnlinePredictor,
    batch: FeatureBatch,
    actual: dict[str, np.ndarray],
) -> Evaluation:
    """Predict every row once (no learning) and score each target over the rows that observed it."""
    predicted = predictor.predict_many(batch)
    quantile = predictor.config.quantile
    served = {
        "ttft": (predicted.ttft_mean, predicted.ttft_quantile),
        "tpot": (predicted.tpot_mean, predicted.tpot_quantile),
    }
    labels = np.array(group_labels(batch))
    overall: dict[str, Scores] = {}
    groups: dict[str, dict[str, Scores]] = {}
    predictions: dict[str, dict[str, np.ndarray]] = {}
    for target in TARGETS:
        seen = actual[target] > 0
        a, (mean, upper) = actual[target][seen], (v[seen] for v in served[target])
        overall[target] = Scores.of(a, mean, upper, quantile)
        target_labels = labels[seen]
        groups[target] = {
            str(g): Scores.of(a[target_labels == g], mean[target_labels == g], upper[target_labels == g], quantile)
            for g in np.unique(target_labels)
        }
        predictions[target] = {"actual": a, "mean": mean, "upper": upper, "group": target_labels}
    return Evaluation(overall, groups, predictions)


@dataclass(frozen=True)
class Decision:
    """Whether to publish, and why, target by target."""

    publish: bool
    reason: str
    wins: dict[str, bool]
    unchanged: list[str] = field(default_factory=list)  # judged targets held to no worse, not to the margin
    kept_mean: list[str] = field(default_factory=list)  # judged targets with new trees whose MAPE is held to no worse

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "publish": self.publish,
            "reason": self.reason,
            "wins": self.wins,
            "unchanged": self.unchanged,
            "kept_mean": self.kept_mean,
        }


def gain_text(old: float, new: float, margin: float, met: bool) -> str:
    """How much lower `new` (MAPE) is than `old`, against `margin`, in words that are true as printed: the margin
    as given (0.5%, not rounded to 0% or 1%), the gain with as many decimals as it takes (one at least) to fall on
    the side of the margin the decision found (`met`): 0.49% is not printed as 0.5% "less than the 0.5% margin".

    >>> gain_text(0.1, 0.0997, 0.005, False), gain_text(0.1, 0.09951, 0.005, False)
    ('0.3% better, less than the 0.5% margin', '0.49% better, less than the 0.5% margin')
    >>> gain_text(0.1, 0.095, 0.02, True), gain_text(0.1, 0.11, 0.02, False)
    ('5.0% better, at least the 2% margin', '10.0% worse, the margin asks 2% better')
    """
    gain = (old - new) / old if old > 0 else 0.0
    shown_margin = f"{margin * 100:g}%"
    if gain < 0:
        return f"{-gain:.1%} worse, the margin asks {shown_margin} better"
    if gain == 0 and not met:
        return f"no better, the margin asks {shown_margin} better"
    return f"{_percent(gain, margin, met)} better, {'at least' if met else 'less than'} the {shown_margin} margin"


def _percent(share: float, margin: float, at_least: bool, most_decimals: int = 6) -> str:
    """`share` as a percentage with the fewest decimals (one at least) at which it reads as at least `margin`
    exactly when `at_least`."""
    decimals = 1
    while decimals < most_decimals and (round(share * 100, decimals) >= round(margin * 100, 9)) != at_least:
        decimals += 1
    return f"{share * 100:.{decimals}f}%"


def decide(
    champion: Evaluation | None,
    challenger: Evaluation,
    margin: float,
    unchanged: Collection[str] = (),
    kept_mean: Collection[str] = (),
) -> Decision:
    """Publish the challenger if there is no champion, or if it wins every target it can be judged on by `margin`.

    A target no row of the slice observed (a prefill-only pool never observes TPOT) is left out: neither model
    can be judged on it, and counting it as lost kept such a fleet's first model for good. At least one target
    must be judged; `wins` holds only the judged ones.

    A target in `unchanged` is one the challenger serves as this champion does (no new trees installed for it):
    its scores are the champion's, never better by the margin, so holding it to the margin kept the champion for
    good whatever the challenger won elsewhere. It wins by being no worse (MAPE and quantile loss), and the
    challenger must still be better on some target.

    A target in `kept_mean` got a new upper-quantile tree but serves this champion's mean tree: its MAPE is the
    champion's own just the same, so it is held to no worse on MAPE, and its quantile loss to no higher as always.
    """
    MARGIN.check("margin", margin)
    if champion is None:
        return Decision(True, "the registry holds no model", {t: True for t in TARGETS})
    judged = [t for t in TARGETS if challenger.overall[t].rows]
    held = [t for t in judged if t in unchanged]
    same_mean = [t for t in judged if t in kept_mean and t not in held]
    wins: dict[str, bool] = {}
    why: list[str] = []
    for target in TARGETS:
        old, new = champion.overall[target], challenger.overall[target]
        if target not in judged:
            why.append(f"{target}: not judged (no row of the evaluation slice observed it)")
            continue
        if target in held:
            no_worse = new.mape <= old.mape and new.pinball <= old.pinball
            wins[target] = no_worse
            why.append(
                f"{target}: no new trees, the champion's own predictions (not held to the margin): "
                f"MAPE {old.mape:.4f} → {new.mape:.4f}, upper-quantile loss {old.pinball:.4f} → {new.pinball:.4f}"
                f" ({'no worse' if no_worse else 'worse'})"
            )
            continue
        if target in same_mean:
            better_mean = new.mape <= old.mape
            mean_text = f"the champion's own mean: {'no worse' if better_mean else 'worse'}"
        else:
            better_mean = new.mape <= (1.0 - margin) * old.mape
            mean_text = gain_text(old.mape, new.mape, margin, better_mean)
        quantile_held = new.pinball <= old.pinball
        wins[target] = better_mean and quantile_held
        why.append(
            f"{target}: MAPE {old.mape:.4f} → {new.mape:.4f} ({mean_text}), "
            f"upper-quantile loss {old.pinball:.4f} → {new.pinball:.4f}"
            f" ({'better' if new.pinball < old.pinball else 'no worse' if quantile_held else 'worse'})"
        )
    if not judged:
        return Decision(False, "the champion stays: no target can be judged: " + "; ".join(why), wins)
    better = any(
        challenger.overall[t].mape < champion.overall[t].mape
        or challenger.overall[t].pinball < champion.overall[t].pinball
        for t in judged
    )
    publish = all(wins.values()) and better
    judged_text = "both targets" if len(judged) == len(TARGETS) else "the one target judged"
    if publish:
        competed = len(judged) - len(held)
        won = "the one target it has new trees for" if held and competed == 1 else judged_text
        verdict = f"the challenger wins {won}"
    elif all(wins.values()):
        verdict = f"the champion stays (the challenger is its equal on {judged_text})"
    else:
        verdict = "the champion stays"
    return Decision(publish, f"{verdict}: " + "; ".join(why), wins, held, same_mean)
