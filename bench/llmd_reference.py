"""A reproduction of llm-d's latency predictor, as the baseline Leadtime must beat.

Gradient-boosted trees (LightGBM here) with 200 trees, depth 6, learning rate 0.05 on llm-d's raw features,
retrained from scratch on everything seen every 100 new rows, and a constant 10 ms before its first retrain,
which is what llm-d's servers start with. Its mean model uses the L2 objective and its upper-quantile model the
quantile objective, as llm-d's two objective modes do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightgbm as lgb
import numpy as np

FEATURES = (
    "is_queued",
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "prefix_cache_score",
    "effective_input_tokens",
    "pod_type",
    "num_tokens_generated",
)
_POD = {"": 0.0, "prefill": 1.0, "decode": 2.0}
COLD_START_MS = 10.0


def llmd_features(rows: Sequence[Mapping[str, Any]]) -> np.ndarray:
    out = np.empty((len(rows), len(FEATURES)))
    for i, r in enumerate(rows):
        waiting = float(r["num_request_waiting"])
        out[i] = (
            1.0 if waiting > 0 else 0.0,
            float(r["kv_cache_percentage"]),
            float(r["input_token_length"]),
            waiting,
            float(r["num_request_running"]),
            float(r.get("prefill_tokens_in_flight", 0)),
            float(r.get("decode_tokens_in_flight", 0)),
            float(r["prefix_cache_score"]),
            (1.0 - float(r["prefix_cache_score"])) * float(r["input_token_length"]),
            _POD.get(r.get("pod_type", "") or "", 0.0),
            float(r.get("num_tokens_generated", 0)),
        )
    return out


def _params(objective: str, quantile: float) -> dict[str, Any]:
    params: dict[str, Any] = {
        "objective": objective,
        "learning_rate": 0.05,
        "max_depth": 6,
        "num_leaves": 63,
        "num_threads": 1,
        "verbosity": -1,
        "seed": 0,
        "deterministic": True,
    }
    if objective == "quantile":
        params["alpha"] = quantile
    return params


class LlmdReference:
    """Per target, a mean and an upper-quantile booster trained on all rows seen so far."""

    def __init__(
        self, quantile: float = 0.9, retrain_every: int = 100, trees: int = 200, with_quantile: bool = True
    ) -> None:
        self.quantile = quantile
        self.with_quantile = with_quantile
        self.retrain_every = retrain_every
        self.trees = trees
        self._x: list[np.ndarray] = []
        self._y: dict[str, list[float]] = {"ttft": [], "tpot": []}
        self._models: dict[str, tuple[lgb.Booster, lgb.Booster] | None] = {"ttft": None, "tpot": None}
        self._since = 0

    def fit(self, x: np.ndarray, ttft: np.ndarray, tpot: np.ndarray) -> None:
        """Train from scratch on these rows (the split evaluation)."""
        self._x = list(x)
        self._y = {"ttft": list(ttft), "tpot": list(tpot)}
        self._retrain()

    def learn_one(self, x: np.ndarray, ttft: float, tpot: float) -> None:
        self._x.append(x)
        self._y["ttft"].append(ttft)
        self._y["tpot"].append(tpot)
        self._since += 1
        if self._since >= self.retrain_every:
            self._retrain()
            self._since = 0

    def _retrain(self) -> None:
        x = np.asarray(self._x)
        for target in ("ttft", "tpot"):
            y = np.asarray(self._y[target])
            mask = y > 0
            if mask.sum() < 10:
                continue
            data = lgb.Dataset(x[mask], label=y[mask], feature_name=list(FEATURES))
            mean = lgb.train(_params("regression", self.quantile), data, num_boost_round=self.trees)
            upper = (
                lgb.train(_params("quantile", self.quantile), data, num_boost_round=self.trees)
                if self.with_quantile
                else mean
            )
            self._models[target] = (mean, upper)

    def predict(self, target: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        models = self._models[target]
        if models is None:
            constant = np.full(len(x), COLD_START_MS)
            return constant, constant
        mean, upper = models
        return np.maximum(mean.predict(x), 0.0), np.maximum(upper.predict(x), 0.0)
