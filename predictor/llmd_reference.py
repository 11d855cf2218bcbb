"""llm-d's latency predictor as its training server publishes it: the peer every Leadtime figure is quoted against.

What it reproduces (llm-d-latency-predictor's training server, as documented there):

- **Training store.** Each target keeps its rows in buckets by (waiting requests: 0, 1–2, 3–5, 6–10, 11+) ×
  (KV-cache use in 20 steps of 5%) × (prefix-cache score in quartiles); a bucket keeps only its newest 500 rows,
  and a model trains on the union of the buckets. On a trace whose load sits in one regime most rows land in one
  bucket, so the model sees only the newest ~500 of them.
- **Test holdout.** About 10% of incoming rows, chosen by a hash of the row, go to a test set and never train.
- **Features per target.** TTFT: is_queued (waiting > 0), kv_cache_percentage, input_token_length,
  num_request_waiting, num_request_running, prefill and decode tokens in flight, prefix_cache_score,
  effective_input_tokens = (1 − prefix_cache_score) × input_token_length, the prefix-score quartile (a category)
  and the pod type (a category: '', prefill, decode). TPOT: is_queued, kv_cache_percentage, input_token_length,
  num_request_waiting, num_request_running, prefill and decode tokens in flight, num_tokens_generated, pod type.
- **Model.** XGBoost (llm-d's default: 200 trees, depth 6, learning rate 0.05, subsampling and column sampling
  0.8, min child weight 5, γ 0.1, histogram method) or LightGBM (200 trees, 31 leaves, depth 6, learning rate
  0.05, column sampling 0.8, L1 and L2 0.1, min 20 rows a leaf); the mean objective is squared error, the
  quantile objective the pinball loss at `quantile`.
- **Queue-gated ensemble** (on by default in llm-d): once a target's store holds ≥ 200 queued (waiting > 0) and
  ≥ 200 non-queued rows, it trains one model on each side and routes each row to its side's model.
- **Cold start.** A constant 10 ms for a target until its first model exists.
- **Retraining.** From scratch on the store, every `retrain_every` learned rows (llm-d's servers retrain on a
  timer, every 10 s or 1,800 s depending on the deployment; the benchmarks use every 100 rows, which on the
  recorded trace is more often than either).

The interface is river-like so that a routing policy can use it online: `learn_many` / `predict_many` take
llm-d rows (dicts, training rows carrying `actual_ttft_ms` / `actual_tpot_ms`; 0 = not observed) or an
`LlmdFrame`, and the constructor does no work. Predictions run through numpy-compiled trees
(`leadtime.predictor.tree_eval`), ~0.1–0.3 ms per model for tens of rows.

Examples
--------
>>> ref = LlmdReference(model="lightgbm", retrain_every=50)
>>> row = {"kv_cache_percentage": 0.2, "input_token_length": 500, "num_request_waiting": 0,
...        "num_request_running": 3, "num_tokens_generated": 0, "prefix_cache_score": 0.0}
>>> float(ref.predict_many([row]).ttft_mean[0])  # nothing learned: llm-d's constant
10.0
>>> rows = [dict(row, input_token_length=100 + 10 * i, actual_ttft_ms=20.0 + 0.1 * i, actual_tpot_ms=0)
...         for i in range(200)]
>>> ref.learn_many(rows)
>>> 30.0 < float(ref.predict_many([dict(row, input_token_length=1500)]).ttft_mean[0]) < 38.0  # actual: 34 ms
True
"""

from __future__ import annotations

import hashlib
import importlib.util
import numbers
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from leadtime.features.rows import LLMD_MODEL_INPUTS, LLMD_REQUIRED_FIELDS
from leadtime.predictor.tree_eval import CompiledEnsemble, compile_lightgbm, compile_xgboost

TARGETS = ("ttft", "tpot")
OBJECTIVES = ("mean", "quantile")
MODEL_TYPES = ("xgboost", "lightgbm")
COLD_START_MS = 10.0
POD_TYPES = {"": 0, "prefill": 1, "decode": 2}

# The per-target feature frames, in column order; "c" marks a categorical column.
TTFT_FEATURES: tuple[tuple[str, str], ...] = (
    ("is_queued", "q"),
    ("kv_cache_percentage", "q"),
    ("input_token_length", "q"),
    ("num_request_waiting", "q"),
    ("num_request_running", "q"),
    ("prefill_tokens_in_flight", "q"),
    ("decode_tokens_in_flight", "q"),
    ("prefix_cache_score", "q"),
    ("effective_input_tokens", "q"),
    ("prefill_score_bucket", "c"),
    ("pod_type", "c"),
)
TPOT_FEATURES: tuple[tuple[str, str], ...] = (
    ("is_queued", "q"),
    ("kv_cache_percentage", "q"),
    ("input_token_length", "q"),
    ("num_request_waiting", "q"),
    ("num_request_running", "q"),
    ("prefill_tokens_in_flight", "q"),
    ("decode_tokens_in_flight", "q"),
    ("num_tokens_generated", "q"),
    ("pod_type", "c"),
)
FEATURES = {"ttft": TTFT_FEATURES, "tpot": TPOT_FEATURES}


def default_model_type() -> str:
    """llm-d's default, XGBoost, where it is installed; LightGBM (a Leadtime dependency) otherwise."""
    return "xgboost" if importlib.util.find_spec("xgboost") is not None else "lightgbm"


@dataclass(frozen=True)
class LlmdFrame:
    """llm-d rows column-wise: the eight numeric inputs, the pod type as a code (0 '', 1 prefill, 2 decode) and
    the two actuals (0 = not observed; all 0 for prediction rows)."""

    columns: dict[str, np.ndarray]
    pod_type: np.ndarray
    actual_ttft_ms: np.ndarray
    actual_tpot_ms: np.ndarray

    def __len__(self) -> int:
        return len(self.pod_type)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> LlmdFrame:
        """llm-d rows → frame; a missing required field, a value that is not a number or an unknown pod type raises
        ValueError naming the row and the field (a row that is not a mapping, TypeError)."""
        if isinstance(rows, Mapping):
            raise TypeError("takes a sequence of rows; got one row (a mapping of llm-d's fields: put it in a list)")
        n = len(rows)
        values = np.zeros((n, len(LLMD_MODEL_INPUTS)))
        pods = np.zeros(n, dtype=np.int64)
        actual = np.zeros((n, 2))
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping):
                raise TypeError(f"rows[{i}] must be a mapping of llm-d's fields, got {type(r).__name__}")
            for name in LLMD_REQUIRED_FIELDS:
                if r.get(name) is None:
                    raise ValueError(f"rows[{i}].{name} is required")
            try:
                values[i] = [float(r.get(name) or 0) for name in LLMD_MODEL_INPUTS]
                actual[i] = (float(r.get("actual_ttft_ms") or 0.0), float(r.get("actual_tpot_ms") or 0.0))
            except (TypeError, ValueError):
                raise ValueError(_not_a_number(i, r)) from None
            pod = r.get("pod_type") or ""
            if pod not in POD_TYPES:
                raise ValueError(f"rows[{i}].pod_type must be '', 'prefill' or 'decode', got {pod!r}")
            pods[i] = POD_TYPES[pod]
        if not np.isfinite(values).all() or not np.isfinite(actual).all():
            raise ValueError("rows hold a value that is not a finite number")
        return cls({name: values[:, j] for j, name in enumerate(LLMD_MODEL_INPUTS)}, pods, actual[:, 0], actual[:, 1])

    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, np.ndarray],
        pod_type: np.ndarray | None = None,
        actual_ttft_ms: np.ndarray | None = None,
        actual_tpot_ms: np.ndarray | None = None,
    ) -> LlmdFrame:
        """Columns named as llm-d's fields (the two tokens-in-flight default to 0)."""
        n = len(columns["input_token_length"])
        cols = {name: np.asarray(columns.get(name, np.zeros(n)), dtype=np.float64) for name in LLMD_MODEL_INPUTS}
        zeros = np.zeros(n)
        return cls(
            cols,
            np.zeros(n, dtype=np.int64) if pod_type is None else np.asarray(pod_type, dtype=np.int64),
            zeros if actual_ttft_ms is None else np.asarray(actual_ttft_ms, dtype=np.float64),
            zeros if actual_tpot_ms is None else np.asarray(actual_tpot_ms, dtype=np.float64),
        )

    def take(self, index: np.ndarray) -> LlmdFrame:
        """The rows at `index`, in that order."""
        return LlmdFrame(
            {k: v[index] for k, v in self.columns.items()},
            self.pod_type[index],
            self.actual_ttft_ms[index],
            self.actual_tpot_ms[index],
        )

    def actual(self, target: str) -> np.ndarray:
        """The observed latency of `target` per row (0: not observed)."""
        return self.actual_ttft_ms if target == "ttft" else self.actual_tpot_ms


def _not_a_number(i: int, row: Mapping[str, Any]) -> str:
    """What `LlmdFrame.from_rows` says of row `i`, one of whose numeric fields `float()` refused: which, and its
    value."""
    for name in (*LLMD_MODEL_INPUTS, "actual_ttft_ms", "actual_tpot_ms"):
        try:
            float(row.get(name) or 0)
        except (TypeError, ValueError):
            return f"rows[{i}].{name} must be a number, got {row.get(name)!r}"
    return f"rows[{i}] holds a value that is not a number"


def prefix_quartile(score: np.ndarray) -> np.ndarray:
    """The prefix-score category: [0, .25] → 0, (.25, .5] → 1, (.5, .75] → 2, (.75, 1] → 3."""
    return np.clip(np.ceil(np.asarray(score) * 4.0) - 1.0, 0.0, 3.0)


def feature_frame(target: str, frame: LlmdFrame) -> np.ndarray:
    """The target's feature matrix, columns in `FEATURES[target]` order."""
    c = frame.columns
    waiting = c["num_request_waiting"]
    derived = {
        "is_queued": (waiting > 0).astype(np.float64),
        "effective_input_tokens": (1.0 - c["prefix_cache_score"]) * c["input_token_length"],
        "prefill_score_bucket": prefix_quartile(c["prefix_cache_score"]),
        "pod_type": frame.pod_type.astype(np.float64),
    }
    return np.column_stack([derived[name] if name in derived else c[name] for name, _ in FEATURES[target]])


def bucket_keys(frame: LlmdFrame) -> np.ndarray:
    """The training-store bucket of each row: queue bucket × 20 KV steps × 4 prefix quartiles, as one integer."""
    c = frame.columns
    queue = np.searchsorted(np.array([0.5, 2.5, 5.5, 10.5]), c["num_request_waiting"])  # 0 | 1-2 | 3-5 | 6-10 | 11+
    kv = np.clip((c["kv_cache_percentage"] * 20).astype(np.int64), 0, 19)
    prefix = np.clip((c["prefix_cache_score"] * 4).astype(np.int64), 0, 3)
    keys: np.ndarray = (queue * 20 + kv) * 4 + prefix
    return keys


def holdout_mask(frame: LlmdFrame, share: float) -> np.ndarray:
    """True for the rows that go to the test set: a stable hash of each row's values below `share`."""
    if share <= 0:
        return np.zeros(len(frame), dtype=bool)
    values = np.column_stack(
        [*(frame.columns[n] for n in LLMD_MODEL_INPUTS), frame.pod_type, frame.actual_ttft_ms, frame.actual_tpot_ms]
    ).astype(np.float64)
    out = np.empty(len(frame), dtype=bool)
    for i, row in enumerate(values):
        digest = hashlib.blake2b(row.tobytes(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little") / 2.0**64 < share
    return out


def model_params(model_type: str, objective: str, quantile: float, seed: int) -> dict[str, Any]:
    """llm-d's hyperparameters for one booster."""
    if model_type == "xgboost":
        params: dict[str, Any] = {
            "max_depth": 6,
            "eta": 0.05,
            "subsample": 0.8,
            "colsample_bytree": 0.8,
            "min_child_weight": 5,
            "gamma": 0.1,
            "tree_method": "hist",
            "nthread": 1,
            "seed": seed,
            "verbosity": 0,
            "objective": "reg:squarederror" if objective == "mean" else "reg:quantileerror",
        }
        if objective == "quantile":
            params["quantile_alpha"] = quantile
        return params
    params = {
        "num_leaves": 31,
        "max_depth": 6,
        "learning_rate": 0.05,
        "min_child_samples": 20,
        "feature_fraction": 0.8,
        "lambda_l1": 0.1,
        "lambda_l2": 0.1,
        "num_threads": 1,
        "seed": seed,
        "deterministic": True,
        "verbosity": -1,
        "objective": "regression" if objective == "mean" else "quantile",
    }
    if objective == "quantile":
        params["alpha"] = quantile
    return params


TREES = 200


def fit_booster(
    model_type: str, target: str, objective: str, x: np.ndarray, y: np.ndarray, quantile: float, seed: int
) -> tuple[Any, CompiledEnsemble]:
    """Train one booster on (x, y) and compile it for prediction."""
    kinds = [kind for _, kind in FEATURES[target]]
    params = model_params(model_type, objective, quantile, seed)
    if model_type == "xgboost":
        import xgboost as xgb

        data = xgb.DMatrix(x, label=y, feature_types=kinds, enable_categorical=True, nthread=1)
        booster = xgb.train(params, data, num_boost_round=TREES)
        return booster, compile_xgboost(booster)
    import lightgbm as lgb

    names = [name for name, _ in FEATURES[target]]
    categorical = [i for i, kind in enumerate(kinds) if kind == "c"]
    dataset = lgb.Dataset(x, label=y, feature_name=names, categorical_feature=categorical, free_raw_data=True)
    lgb_booster = lgb.train(params, dataset, num_boost_round=TREES)
    return lgb_booster, compile_lightgbm(lgb_booster)


@dataclass
class _TargetStore:
    """One target's bucketed training rows (feature vector, actual), newest `per_bucket` per bucket."""

    per_bucket: int
    buckets: dict[int, deque[tuple[np.ndarray, float]]] = field(default_factory=dict)
    test_rows: int = 0

    def add(self, keys: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        for key, row, value in zip(keys.tolist(), x, y.tolist(), strict=True):
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = deque(maxlen=self.per_bucket)
            bucket.append((row, value))

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        items = [item for bucket in self.buckets.values() for item in bucket]
        if not items:
            return np.zeros((0, 0)), np.zeros(0)
        return np.array([r for r, _ in items]), np.array([v for _, v in items])


@dataclass(frozen=True)
class LlmdPredictions:
    """Milliseconds per row; an objective the reference does not train is None."""

    ttft_mean: np.ndarray | None
    ttft_quantile: np.ndarray | None
    tpot_mean: np.ndarray | None
    tpot_quantile: np.ndarray | None

    def get(self, target: str, objective: str) -> np.ndarray | None:
        """One target's predictions for one objective (None when that objective is not trained)."""
        value: np.ndarray | None = getattr(self, f"{target}_{objective}")
        return value


# One target's serving models: objective → [model for all rows] or [non-queued model, queued model].
_Models = dict[str, list[CompiledEnsemble]]


class LlmdReference:
    """llm-d's latency predictor (see the module docstring), for benchmarks and for routing policies.

    Parameters
    ----------
    model
        "xgboost" or "lightgbm"; None: XGBoost where installed (llm-d's default), else LightGBM.
    quantile
        The quantile objective's level (llm-d's default 0.9).
    objectives
        Which of "mean" and "quantile" to train (llm-d runs one of them; benchmarks score both).
    retrain_every
        Learned rows between retrains; None retrains only when `retrain()` is called.
    bucket_size
        Rows kept per training-store bucket (newest first).
    test_share
        Share of rows held out as test data (never trained on).
    ensemble
        Whether to train the queue-gated ensemble once both sides have `ensemble_min_rows` rows.
    ensemble_min_rows
        Rows each side (queued, non-queued) needs before the gated models replace the single one.
    min_rows
        Rows a target needs before its first model is trained.
    seed
        Seed of the boosters' sampling.
    """

    def __init__(
        self,
        model: str | None = None,
        quantile: float = 0.9,
        objectives: Sequence[str] = OBJECTIVES,
        retrain_every: int | None = 100,
        bucket_size: int = 500,
        test_share: float = 0.1,
        ensemble: bool = True,
        ensemble_min_rows: int = 200,
        min_rows: int = 10,
        seed: int = 42,
    ) -> None:
        self.model = model
        self.quantile = quantile
        self.objectives = tuple(objectives)
        self.retrain_every = retrain_every
        self.bucket_size = bucket_size
        self.test_share = test_share
        self.ensemble = ensemble
        self.ensemble_min_rows = ensemble_min_rows
        self.min_rows = min_rows
        self.seed = seed
        self._check_settings()
        self._stores: dict[str, _TargetStore] = {}
        self._models: dict[str, _Models] = {}
        self._since_retrain = 0
        self.retrains = 0

    def _check_settings(self) -> None:
        """Every setting checked here, by name: one that fails later does so inside a `learn_many`, after rows went
        into the store (a quantile of 1.5 at the first retrain), or never (`retrain_every=0` looped for ever, and an
        unknown objective trained nothing)."""
        if self.model is not None and self.model not in MODEL_TYPES:
            raise ValueError(f"model must be one of {', '.join(MODEL_TYPES)} or None, got {self.model!r}")
        quantile = self.quantile
        if isinstance(quantile, bool) or not isinstance(quantile, numbers.Real) or not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be a number in (0, 1), got {quantile!r}")
        unknown = [o for o in self.objectives if o not in OBJECTIVES]
        if unknown or not self.objectives:
            raise ValueError(f"objectives must name one or both of {', '.join(OBJECTIVES)}, got {self.objectives!r}")
        least = {"bucket_size": 1, "ensemble_min_rows": 1, "min_rows": 1, "seed": 0}
        if self.retrain_every is not None:
            least["retrain_every"] = 1
        for name, low in least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                none = " or None" if name == "retrain_every" else ""
                raise ValueError(f"{name} must be an integer ≥ {low}{none}, got {value!r}")
        share = self.test_share
        if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0.0 <= share < 1.0:
            raise ValueError(f"test_share must be a number in [0, 1), got {share!r}")

    # --- state --------------------------------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        """The library the trees come from: the one asked for, else XGBoost where installed."""
        return default_model_type() if self.model is None else self.model

    def _store(self, target: str) -> _TargetStore:
        store = self._stores.get(target)
        if store is None:
            store = self._stores[target] = _TargetStore(self.bucket_size)
        return store

    def status(self) -> dict[str, Any]:
        """Training and test rows per target, whether each has a model and whether it is gated."""
        return {
            "model_type": self.model_type,
            "training_rows": {t: len(self._store(t)) for t in TARGETS},
            "test_rows": {t: self._store(t).test_rows for t in TARGETS},
            "buckets": {t: len(self._store(t).buckets) for t in TARGETS},
            "has_model": {t: t in self._models for t in TARGETS},
            "gated": {t: any(len(m) == 2 for m in self._models.get(t, {}).values()) for t in TARGETS},
            "retrains": self.retrains,
        }

    # --- learning -----------------------------------------------------------------------------------------

    def learn_many(self, rows: Sequence[Mapping[str, Any]] | LlmdFrame) -> None:
        """Add training rows (actuals of 0 are 'not observed'); retrain when `retrain_every` rows have come in
        since the last retrain (a batch crossing several such points retrains at each)."""
        frame = rows if isinstance(rows, LlmdFrame) else LlmdFrame.from_rows(rows)
        if self.retrain_every is None:
            self._add(frame)
            return
        start = 0
        while start < len(frame):
            stop = min(len(frame), start + self.retrain_every - self._since_retrain)
            self._add(frame.take(np.arange(start, stop)))
            self._since_retrain += stop - start
            if self._since_retrain >= self.retrain_every:
                self.retrain()
            start = stop

    def learn_one(self, row: Mapping[str, Any]) -> None:
        """`learn_many` of one training row."""
        self.learn_many([row])

    def _add(self, frame: LlmdFrame) -> None:
        test = holdout_mask(frame, self.test_share)
        keys = bucket_keys(frame)
        for target in TARGETS:
            actual = frame.actual(target)
            observed = actual > 0
            store = self._store(target)
            store.test_rows += int((observed & test).sum())
            train = np.flatnonzero(observed & ~test)
            if len(train):
                store.add(keys[train], feature_frame(target, frame.take(train)), actual[train])

    def fit(self, rows: Sequence[Mapping[str, Any]] | LlmdFrame) -> None:
        """Learn these rows (through the store and the holdout, as llm-d would) and train once."""
        every, self.retrain_every = self.retrain_every, None
        try:
            self.learn_many(rows)
        finally:
            self.retrain_every = every
        self.retrain()

    def retrain(self) -> None:
        """Train every target's models from scratch on its store (queue-gated where both sides are large)."""
        self._since_retrain = 0
        self.retrains += 1
        for target in TARGETS:
            x, y = self._store(target).rows()
            if len(y) < self.min_rows:
                continue
            queued = x[:, 0] > 0
            sides: list[np.ndarray] = [np.arange(len(y))]
            if self.ensemble and min(int(queued.sum()), int((~queued).sum())) >= self.ensemble_min_rows:
                sides = [np.flatnonzero(~queued), np.flatnonzero(queued)]
            models: _Models = {}
            for objective in self.objectives:
                models[objective] = [
                    fit_booster(self.model_type, target, objective, x[s], y[s], self.quantile, self.seed)[1]
                    for s in sides
                ]
            self._models[target] = models

    # --- prediction ---------------------------------------------------------------------------------------

    def predict_many(self, rows: Sequence[Mapping[str, Any]] | LlmdFrame) -> LlmdPredictions:
        """Predicted milliseconds (≥ 0) per row for each trained objective; 10 ms before a target's first model."""
        frame = rows if isinstance(rows, LlmdFrame) else LlmdFrame.from_rows(rows)
        out: dict[str, np.ndarray | None] = {}
        for target in TARGETS:
            models = self._models.get(target)
            x = feature_frame(target, frame) if models is not None else None
            for objective in OBJECTIVES:
                key = f"{target}_{objective}"
                if objective not in self.objectives:
                    out[key] = None
                elif models is None or x is None:
                    out[key] = np.full(len(frame), COLD_START_MS)
                else:
                    out[key] = np.maximum(_predict_gated(models[objective], x), 0.0)
        return LlmdPredictions(**out)

    def predict_one(self, row: Mapping[str, Any]) -> dict[str, float]:
        """Every trained prediction for one row, keyed `<target>_<objective>`."""
        p = self.predict_many([row])
        return {f"{t}_{o}": float(v[0]) for t in TARGETS for o in OBJECTIVES if (v := p.get(t, o)) is not None}


def _predict_gated(models: list[CompiledEnsemble], x: np.ndarray) -> np.ndarray:
    if len(models) == 1:
        return models[0].predict(x)
    queued = x[:, 0] > 0
    out = np.empty(len(x))
    for side, model in ((~queued, models[0]), (queued, models[1])):
        if side.any():
            out[side] = model.predict(x[side])
    return out
