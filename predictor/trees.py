"""LightGBM refinements of the online model's residual, trained in the background on the sample window.

The trees never replace the physics: they learn what is left of log(actual) after prior × online correction,
so they add structure the linear correction cannot express (interactions, thresholds) without having to
extrapolate load levels they have not seen. A candidate is accepted only if it beats the current serving model
on the most recent held-out observations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightgbm as lgb
import numpy as np

from features.vectorize import COLUMNS

TREE_FEATURES: tuple[str, ...] = (*COLUMNS, "log_prior")

# Physics says these never lower the target: more queued work never makes the first token come sooner,
# a bigger running batch never makes a decode step faster.
_MONOTONE_INCREASING = {
    "ttft": ("num_request_waiting", "prefill_tokens_in_flight", "uncached_tokens"),
    "tpot": ("num_request_running", "kv_cache_percentage", "decode_tokens_in_flight"),
}


def monotone_constraints(target: str) -> list[int]:
    up = _MONOTONE_INCREASING[target]
    return [1 if name in up else 0 for name in TREE_FEATURES]


def tree_params(target: str, objective: str, quantile: float, seed: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "objective": objective,
        "learning_rate": 0.05,
        "num_leaves": 15,
        "max_depth": 5,
        "min_data_in_leaf": 20,
        "lambda_l2": 1.0,
        "feature_fraction": 0.9,
        "bagging_fraction": 0.9,
        "bagging_freq": 1,
        "num_threads": 1,
        "seed": seed,
        "deterministic": True,
        "force_row_wise": True,
        "verbosity": -1,
    }
    if objective == "quantile":
        # LightGBM refuses monotone constraints with the quantile objective; the upper quantile is
        # monotone through the point prediction it is added to and the floor at the point prediction.
        params["alpha"] = quantile
    else:
        params["monotone_constraints"] = monotone_constraints(target)
        params["monotone_constraints_method"] = "advanced"
    return params


def fit_booster(
    target: str, objective: str, quantile: float, x: np.ndarray, y: np.ndarray, rounds: int, seed: int
) -> lgb.Booster:
    data = lgb.Dataset(x, label=y, feature_name=list(TREE_FEATURES), free_raw_data=True)
    return lgb.train(tree_params(target, objective, quantile, seed), data, num_boost_round=rounds)


@dataclass
class ResidualTrees:
    """The trees serving one target: a mean-residual booster and/or an upper-quantile booster."""

    mean: lgb.Booster | None = None
    upper: lgb.Booster | None = None

    def predict_mean(self, features: np.ndarray) -> np.ndarray | None:
        if self.mean is None:
            return None
        return np.asarray(self.mean.predict(features, num_threads=1))

    def predict_upper(self, features: np.ndarray) -> np.ndarray | None:
        if self.upper is None:
            return None
        return np.asarray(self.upper.predict(features, num_threads=1))

    def to_dict(self) -> dict[str, str | None]:
        return {
            "mean": self.mean.model_to_string() if self.mean is not None else None,
            "upper": self.upper.model_to_string() if self.upper is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResidualTrees:
        def load(text: Any) -> lgb.Booster | None:
            if text is None:
                return None
            if not isinstance(text, str) or not text.startswith("tree"):
                raise ValueError("tree model is not LightGBM text")
            booster = lgb.Booster(model_str=text)
            if booster.feature_name() != list(TREE_FEATURES):
                raise ValueError("tree model was trained on other features")
            return booster

        return cls(mean=load(d.get("mean")), upper=load(d.get("upper")))
