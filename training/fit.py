"""The residual trees of one target, fitted on a long history: a small search, early stopping, a calibrated p90.

What is fitted is what the online predictor's own retrain fits on its 20,000-row window (`predictor/trees.py`):
a booster for the point ("mean") prediction and an upper-quantile booster over `TREE_FEATURES` (every
`features/` column plus the log of the physics prior), learning the log residual that the online parts leave,
with the learner's parameters (monotone constraints where physics says more load never means faster). The job
only changes how much history they see and searches a few parameters the learner fixes:

- a small grid (scikit-learn's `ParameterGrid`) over leaves and the least rows per leaf, each setting scored on
  `TimeSeriesSplit` folds of the history (fit on the past, validate on the block after it): the point booster by
  the APE of its prediction, the quantile booster by its pinball loss;
- for the point booster also its objective: the learner's least squares on log latency (monotone), or the
  median of the log latency (LightGBM's quantile objective at 0.5, which takes no monotone constraints).
  Percentage errors reward the median, and on skewed latency the least-squares fit overshoots it (the reason
  the online learner recentres its point prediction on the median residual); the folds decide;
- early stopping on each fold's validation block, at the round after which `patience` rounds brought no better
  validation loss (LightGBM's rule; the Dask trainer, whose workers cannot stop early together, fits every round
  and applies the same rule to the whole validation curve);
- the chosen setting's fit on the last fold (trained on all history but its most recent block, stopped early on
  that block) is the candidate; the quantile booster is calibrated by a split-conformal log shift fitted on the
  older half of that block;
- as in the learner, a candidate replaces what the model serves now (its trees, or the median recentring and the
  conformal offset without them) only if it beats it by 1% on that block: the mean booster on its APE, the
  quantile booster, with its shift, on its pinball loss over the newer half (the shift did not see it). Trees
  refine the residual; where they do not, the model keeps what it had.

Trees stay small (at most 9 leaves, so that the service's compiled evaluator, which handles 8 splits a tree,
serves them at a fraction of LightGBM's per-call cost), and at most `max_rounds` of them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import lightgbm as lgb
import numpy as np
from sklearn.metrics import mean_pinball_loss
from sklearn.model_selection import ParameterGrid

from leadtime.predictor.trees import TREE_FEATURES, tree_params
from leadtime.training.split import search_folds

ROLES = ("mean", "upper")  # the point prediction's booster and the upper quantile's
MEAN_OBJECTIVES = ("regression", "median")  # least squares on the log residual, or its median
UPPER_OBJECTIVE = "quantile"
MAX_LEAVES = 9  # the compiled evaluator's limit (8 splits a tree)
DEFAULT_GRID: dict[str, list[Any]] = {"num_leaves": [5, 9], "min_data_in_leaf": [20, 200]}


@dataclass(frozen=True)
class SearchConfig:
    """How the trees of one target are searched and fitted.

    Parameters
    ----------
    grid
        Values tried for LightGBM parameters (every combination); `num_leaves` at most `MAX_LEAVES`.
    folds
        `TimeSeriesSplit` folds of the history each setting is scored on.
    learning_rate, max_rounds, patience
        Shrinkage, most boosting rounds, and rounds without a better validation loss before stopping.
    quantile
        The upper quantile served (the champion's, or 0.9).
    seed
        Seed of LightGBM's bagging.
    num_threads
        LightGBM threads in a local fit. One by default: OpenMP's waiting threads spin, and beside other busy
        processes on a 2-core machine two threads made the search ~40x slower (12 s against 0.3 s).
    """

    grid: dict[str, list[Any]] = field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_GRID.items()})
    folds: int = 2
    learning_rate: float = 0.1
    max_rounds: int = 300
    patience: int = 20
    quantile: float = 0.9
    seed: int = 0
    num_threads: int = 1

    def __post_init__(self) -> None:
        leaves = self.grid.get("num_leaves", [7])
        if any(int(v) > MAX_LEAVES or int(v) < 2 for v in leaves):
            raise ValueError(f"num_leaves must be within 2..{MAX_LEAVES} (the service's compiled trees)")
        if self.max_rounds < 1 or self.patience < 1 or self.folds < 2:
            raise ValueError("max_rounds and patience must be ≥ 1, folds ≥ 2")
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError(f"quantile must be in [0.5, 1), got {self.quantile}")

    def settings(self) -> list[dict[str, Any]]:
        """Every parameter setting of the grid, in a fixed order.

        >>> SearchConfig().settings()[0]
        {'min_data_in_leaf': 20, 'num_leaves': 5}
        """
        return list(ParameterGrid(self.grid))


def booster_params(target: str, objective: str, setting: dict[str, Any], config: SearchConfig) -> dict[str, Any]:
    """The online learner's tree parameters for `target` and `objective` (``regression``, ``median`` or
    ``quantile``, the served upper quantile), with the setting searched.

    >>> p = booster_params("ttft", "quantile", {"num_leaves": 5}, SearchConfig())
    >>> p["objective"], p["alpha"], p["num_leaves"], "monotone_constraints" in p
    ('quantile', 0.9, 5, False)
    >>> p = booster_params("ttft", "median", {}, SearchConfig())
    >>> p["objective"], p["alpha"]
    ('quantile', 0.5)
    """
    if objective == "median":
        params = tree_params(target, "quantile", 0.5, config.seed)
    else:
        params = tree_params(target, objective, config.quantile, config.seed)
    params.update(setting)
    params["learning_rate"] = config.learning_rate
    params["num_threads"] = config.num_threads
    params["feature_pre_filter"] = False  # one Dataset's bins serve settings with another min_data_in_leaf
    return params


class Trainer(Protocol):
    """Where boosters are fitted: in this process (`LocalTrainer`) or on a Dask cluster (`DaskTrainer`)."""

    name: str

    def prepare(self, x: np.ndarray, y: np.ndarray) -> Any:
        """Place one fold's fitting rows once, for every setting and objective fitted on them."""
        ...

    def train(
        self, params: dict[str, Any], data: Any, x_valid: np.ndarray, y_valid: np.ndarray, rounds: int, patience: int
    ) -> lgb.Booster:
        """A booster stopped early on the validation rows, holding only its rounds up to the best one."""
        ...

    def release(self, data: Any) -> None:
        """Free what `prepare` placed."""
        ...

    def interrupted(self) -> None:
        """The job was interrupted (Ctrl-C): leave nothing behind that would print on the way out."""
        ...


class LocalTrainer:
    """Fits in this process with LightGBM's own early stopping."""

    name = "local"

    def prepare(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Nothing to place: the arrays themselves."""
        return x, y

    def train(
        self,
        params: dict[str, Any],
        data: tuple[np.ndarray, np.ndarray],
        x_valid: np.ndarray,
        y_valid: np.ndarray,
        rounds: int,
        patience: int,
    ) -> lgb.Booster:
        """`lgb.train` with the early-stopping callback, truncated at the best round."""
        x, y = data
        fit_set = lgb.Dataset(x, label=y, feature_name=list(TREE_FEATURES), params={"feature_pre_filter": False})
        valid_set = lgb.Dataset(x_valid, label=y_valid, reference=fit_set)
        booster = lgb.train(
            params,
            fit_set,
            num_boost_round=rounds,
            valid_sets=[valid_set],
            callbacks=[lgb.early_stopping(patience, first_metric_only=True, verbose=False)],
        )
        best = booster.best_iteration or booster.current_iteration()
        return truncated(booster, best)

    def release(self, data: Any) -> None:
        """Nothing placed."""

    def interrupted(self) -> None:
        """Nothing runs elsewhere."""


def truncated(booster: lgb.Booster, rounds: int) -> lgb.Booster:
    """A booster of the first `rounds` rounds only (what is published: no tree past the best round)."""
    return lgb.Booster(model_str=booster.model_to_string(num_iteration=rounds))


def validation_loss(params: dict[str, Any], actual: np.ndarray, predicted: np.ndarray) -> float:
    """The loss early stopping watches: LightGBM's default metric of the booster's objective (l2, or the pinball
    loss at its quantile).

    >>> validation_loss({"objective": "regression"}, np.array([1.0, 2.0]), np.array([1.0, 0.0]))
    2.0
    """
    if params["objective"] == "quantile":
        return float(mean_pinball_loss(actual, predicted, alpha=float(params["alpha"])))
    return float(np.mean((actual - predicted) ** 2))


def early_stopping_round(curve: Sequence[float], patience: int) -> int:
    """LightGBM's early-stopping rule over a whole validation curve: the best round (1-based) seen before
    `patience` rounds in a row brought nothing better.

    >>> early_stopping_round([5.0, 4.0, 4.5, 3.0, 3.5, 3.6, 3.7, 2.0], patience=3)
    4
    """
    best, best_round = math.inf, 0
    for i, loss in enumerate(curve):
        if loss < best:
            best, best_round = loss, i
        elif i - best_round >= patience:
            break
    return best_round + 1


def mean_ape(residual: np.ndarray, predicted: np.ndarray) -> float:
    """Mean absolute percentage error of a log-residual prediction (the trees' part of exp(log prediction)).

    >>> round(mean_ape(np.log(np.array([2.0, 1.0])), np.zeros(2)), 3)
    0.25
    """
    return float(np.mean(np.abs(np.expm1(predicted - residual))))


def _score(role: str, quantile: float, residual: np.ndarray, predicted: np.ndarray) -> float:
    """What the search ranks settings by: the APE of the point booster, the pinball loss of the quantile one."""
    if role == "upper":
        return float(mean_pinball_loss(residual, predicted, alpha=quantile))
    return mean_ape(residual, predicted)


def _candidates(settings: list[dict[str, Any]]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """(objective, setting) pairs the search tries for each role."""
    return {
        "mean": [(objective, setting) for objective in MEAN_OBJECTIVES for setting in settings],
        "upper": [(UPPER_OBJECTIVE, setting) for setting in settings],
    }


@dataclass
class SettingScore:
    """One objective and setting of one role: its validation score and best round on every fold."""

    role: str
    objective: str
    setting: dict[str, Any]
    fold_scores: list[float]
    fold_rounds: list[int]

    @property
    def score(self) -> float:
        """Mean over the folds."""
        return float(np.mean(self.fold_scores))


_ACCEPT = 0.99  # a candidate must beat what serves by 1% (the learner's own rule)


@dataclass
class TargetTrees:
    """The trees of one target: the candidates fitted, which of them beat what the model serves, and why."""

    target: str
    candidate_mean: lgb.Booster
    candidate_upper: lgb.Booster
    upper_shift: float
    calibration_residuals: np.ndarray  # the last fold's validation residuals (the split-conformal base)
    search: list[SettingScore]
    chosen: dict[str, dict[str, Any]]  # role → {"objective": ..., **setting}
    rows: dict[str, int]  # fit / validation rows of the final fit
    accepted: dict[str, bool]  # role → whether its candidate beat what serves
    validation: dict[str, dict[str, float]]  # role → {"serving": score, "candidate": score}

    @property
    def mean(self) -> lgb.Booster | None:
        """The point booster to install, or None to keep what serves."""
        return self.candidate_mean if self.accepted["mean"] else None

    @property
    def upper(self) -> lgb.Booster | None:
        """The quantile booster to install, or None to keep what serves."""
        return self.candidate_upper if self.accepted["upper"] else None

    @property
    def installs(self) -> bool:
        """Whether anything is installed."""
        return any(self.accepted.values())

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the search, the chosen settings, tree counts, the quantile shift, what was accepted."""
        return {
            "rows": self.rows,
            "chosen": self.chosen,
            "trees": {"mean": self.candidate_mean.num_trees(), "upper": self.candidate_upper.num_trees()},
            "accepted": self.accepted,
            "validation": self.validation,
            "upper_shift": self.upper_shift,
            "search": [
                {
                    "role": s.role,
                    "objective": s.objective,
                    "setting": s.setting,
                    "score": s.score,
                    "fold_scores": s.fold_scores,
                    "fold_rounds": s.fold_rounds,
                }
                for s in self.search
            ],
        }


def fit_target(
    target: str,
    x: np.ndarray,
    residual: np.ndarray,
    serving: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    config: SearchConfig,
    trainer: Trainer,
    tick: Callable[[str], None] | None = None,
) -> TargetTrees:
    """Search, fit and calibrate the trees of `target` on time-ordered tree inputs and log residuals.

    `serving(x)` is what the model adds to its online parts now, (mean, upper) per row: the baseline a candidate
    must beat. `tick(what)` is called after every booster fitted (`fits_per_target(config)` in all).
    """
    folds = search_folds(len(residual), config.folds)
    candidates = _candidates(config.settings())
    scores = {role: [SettingScore(role, o, s, [], []) for o, s in pairs] for role, pairs in candidates.items()}
    last_fit: dict[tuple[str, int], lgb.Booster] = {}
    for k, (fit_rows, valid_rows) in enumerate(folds):
        x_valid, r_valid = x[valid_rows], residual[valid_rows]
        with _placed(trainer, x[fit_rows], residual[fit_rows]) as data:
            for role, pairs in candidates.items():
                for j, (objective, setting) in enumerate(pairs):
                    params = booster_params(target, objective, setting, config)
                    booster = trainer.train(params, data, x_valid, r_valid, config.max_rounds, config.patience)
                    predicted = np.asarray(booster.predict(x_valid, num_threads=1))
                    entry = scores[role][j]
                    entry.fold_scores.append(_score(role, config.quantile, r_valid, predicted))
                    entry.fold_rounds.append(booster.current_iteration())
                    if k == len(folds) - 1:
                        last_fit[(role, j)] = booster
                    if tick is not None:
                        tick(f"{target} {role} fold {k + 1}/{len(folds)}")
    best = {role: int(np.argmin([s.score for s in scores[role]])) for role in ROLES}
    mean, upper = last_fit[("mean", best["mean"])], last_fit[("upper", best["upper"])]
    fit_rows, valid_rows = folds[-1]
    x_valid, r_valid = x[valid_rows], residual[valid_rows]
    serving_mean, serving_upper = serving(x_valid)
    mean_valid = np.asarray(mean.predict(x_valid, num_threads=1))
    upper_valid = np.asarray(upper.predict(x_valid, num_threads=1))
    half = len(r_valid) // 2
    shift = float(np.quantile(r_valid[:half] - upper_valid[:half], config.quantile))
    q = config.quantile
    validation = {
        "mean": {"serving": mean_ape(r_valid, serving_mean), "candidate": mean_ape(r_valid, mean_valid)},
        "upper": {
            "serving": _score("upper", q, r_valid[half:], serving_upper[half:]),
            "candidate": _score("upper", q, r_valid[half:], upper_valid[half:] + shift),
        },
    }
    return TargetTrees(
        target=target,
        candidate_mean=mean,
        candidate_upper=upper,
        upper_shift=shift,
        calibration_residuals=r_valid.copy(),
        search=[s for role in ROLES for s in scores[role]],
        chosen={
            role: {"objective": candidates[role][best[role]][0], **candidates[role][best[role]][1]} for role in ROLES
        },
        rows={"fit": len(fit_rows), "validation": len(valid_rows)},
        accepted={role: v["candidate"] < _ACCEPT * v["serving"] for role, v in validation.items()},
        validation=validation,
    )


def fits_per_target(config: SearchConfig) -> int:
    """Boosters `fit_target` fits: folds × (objectives tried) × settings."""
    return config.folds * (len(MEAN_OBJECTIVES) + 1) * len(config.settings())


@contextlib.contextmanager
def _placed(trainer: Trainer, x: np.ndarray, y: np.ndarray) -> Iterator[Any]:
    data = trainer.prepare(x, y)
    try:
        yield data
    finally:
        trainer.release(data)
