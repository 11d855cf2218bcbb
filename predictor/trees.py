"""LightGBM refinements of the online model's residual, trained in the background on the sample window.

The trees never replace the physics: they learn what is left of log(actual) after prior × online correction,
so they add structure the linear correction cannot express (interactions, thresholds) without having to
extrapolate load levels they have not seen. A candidate is accepted only if it beats the current serving model
on the most recent held-out observations.
"""

from __future__ import annotations

import hashlib
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
        # Small trees, few rounds: they refine a residual, and they sit on the prediction hot path, where
        # LightGBM's cost grows with trees × leaves (120 × 15 cost ~4x the 60 × 7 used here, 100 rows).
        "learning_rate": 0.1,
        "num_leaves": 7,
        "max_depth": 4,
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


def check_lightgbm_text(text: str) -> None:
    """Refuse text that is not a complete LightGBM model *before* LightGBM parses it.

    LightGBM's parser aborts the whole process on some malformed inputs (a truncated model, say), so a corrupt
    artifact must be caught here: the header must declare the tree sizes, and each tree must sit at the place
    and with the length the header says.
    """
    if not text.startswith("tree\n"):
        raise ValueError("tree model is not LightGBM text")
    header_end = text.find("\n\n")
    if header_end < 0:
        raise ValueError("tree model is not LightGBM text: no header")
    sizes_line = [ln for ln in text[:header_end].split("\n") if ln.startswith("tree_sizes=")]
    if len(sizes_line) != 1:
        raise ValueError("tree model is not LightGBM text: no tree_sizes")
    try:
        sizes = [int(v) for v in sizes_line[0][len("tree_sizes=") :].split()]
    except ValueError:
        raise ValueError("tree model is not LightGBM text: bad tree_sizes") from None
    encoded = text.encode()
    position = len(text[: header_end + 2].encode())
    for i, size in enumerate(sizes):
        if size <= 0 or not encoded.startswith(f"Tree={i}\n".encode(), position):
            raise ValueError(f"tree model is not LightGBM text: tree {i} is missing or misplaced (truncated?)")
        position += size
    end_of_trees = encoded.find(b"end of trees", position)
    if end_of_trees < 0 or encoded.find(b"\nend of parameters\n", end_of_trees) < 0:
        raise ValueError("tree model is not LightGBM text: it is truncated")
    if not encoded.rstrip(b"\n").rsplit(b"\n", 1)[-1].startswith(b"pandas_categorical:"):
        raise ValueError("tree model is not LightGBM text: it is truncated")


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
        out: dict[str, str | None] = {}
        for name, booster in (("mean", self.mean), ("upper", self.upper)):
            text = booster.model_to_string() if booster is not None else None
            out[name] = text
            out[f"{name}_sha256"] = hashlib.sha256(text.encode()).hexdigest() if text is not None else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResidualTrees:
        def load(text: Any, digest: Any) -> lgb.Booster | None:
            if text is None:
                return None
            if not isinstance(text, str):
                raise ValueError("tree model is not LightGBM text")
            check_lightgbm_text(text)
            if digest != hashlib.sha256(text.encode()).hexdigest():
                raise ValueError("tree model does not match its checksum (corrupted?)")
            booster = lgb.Booster(model_str=text)
            if booster.feature_name() != list(TREE_FEATURES):
                raise ValueError("tree model was trained on other features")
            return booster

        return cls(mean=load(d.get("mean"), d.get("mean_sha256")), upper=load(d.get("upper"), d.get("upper_sha256")))
