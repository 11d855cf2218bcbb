"""The predictor as the router plugin sees it: one bulk call scores every candidate row, one call reports outcomes.

Three implementations satisfy `PredictorClient`: `InProcessPredictor` wraps an online predictor living in the
router's own process (the simulator, the tests, `leadtime route --embedded`), and the service's HTTP and gRPC
clients (`leadtime.predictor.client`) already have this shape. The plugin depends on this protocol only, never on
the predictor's internals, so any of them can stand behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from leadtime.features.errors import FeatureError
from leadtime.features.rows import FeatureRow, Observation
from leadtime.predictor.client import (
    INVALID_ANSWER,
    BulkPredictions,
    PredictorError,
    PredictorUnavailable,
    require_rows,
    served,
)

__all__ = [
    "INVALID_ANSWER",
    "BulkPredictions",
    "InProcessPredictor",
    "LocalLearner",
    "PredictorClient",
    "PredictorError",
    "PredictorUnavailable",
    "predict_in_process",
]


@runtime_checkable
class PredictorClient(Protocol):
    """Predict every row of one routing decision in one call; report observations in batches."""

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        """Mean and upper-quantile TTFT and TPOT (ms) per row, in row order."""
        ...

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        """Hand completed requests to the learner; returns how many were accepted."""
        ...


class LocalLearner(Protocol):
    """What an in-process learner offers (the shape of `leadtime.predictor.learner.OnlinePredictor`)."""

    def predict_many(self, rows: Sequence[FeatureRow]) -> Any: ...

    def learn_many(self, observations: Sequence[Observation]) -> None: ...


def require_predictor_client(predictor: object) -> None:
    """TypeError, saying what to wrap it in, for a predictor that is not a `PredictorClient` (an `OnlinePredictor`
    given as is failed at the first pick, without a word of why)."""
    if not isinstance(predictor, PredictorClient):
        raise TypeError(
            f"predictor must be a PredictorClient, got {type(predictor).__name__} (in process: "
            "InProcessPredictor(OnlinePredictor(...)))"
        )


def predict_in_process(learner: LocalLearner, rows: Sequence[FeatureRow], quantile: float) -> BulkPredictions:
    """`learner`'s predictions of `rows`, answered as the service answers: a row it cannot read (an unknown
    accelerator class) is a PredictorError, as over HTTP (422) and gRPC, so that a policy falls back alike
    whichever client stands behind it, and a gateway takes it for refused rows, not for a predictor failing
    (whose breaker would then leave it unasked for the other decisions too); an overflow, NaN or negative is served
    as the service serves it (`served`): handed on as it was, the policy refused it and fell back to the heuristics
    where the service would have routed on it."""
    require_rows(rows)
    try:
        p = learner.predict_many(rows)
    except FeatureError as err:
        raise PredictorError("invalid", str(err)) from None
    return BulkPredictions(
        served(p.ttft_mean),
        served(p.ttft_quantile),
        served(p.tpot_mean),
        served(p.tpot_quantile),
        int(getattr(p, "model_version", 0)),
        quantile,
    )


class InProcessPredictor:
    """A `PredictorClient` over a learner in this process: no network, no deadline to miss.

    Parameters
    ----------
    learner
        An object with `predict_many(rows)` returning per-row arrays `ttft_mean`, `ttft_quantile`, `tpot_mean`,
        `tpot_quantile` (and `model_version`), and `learn_many(observations)`.
    quantile
        The upper quantile the learner serves, reported with each answer: by default its own (`learner.config.
        quantile`, as an `OnlinePredictor` has it), else 0.9.

    >>> from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
    >>> InProcessPredictor(OnlinePredictor(LearnerConfig(quantile=0.95, background=False))).quantile
    0.95
    """

    def __init__(self, learner: LocalLearner, quantile: float | None = None) -> None:
        self.learner = learner
        if quantile is None:
            quantile = float(getattr(getattr(learner, "config", None), "quantile", 0.9))
        self.quantile = quantile

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        """`predict_in_process`."""
        return predict_in_process(self.learner, rows, self.quantile)

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        if observations:
            try:
                self.learner.learn_many(observations)
            except FeatureError as err:
                raise PredictorError("invalid", str(err)) from None
        return len(observations)
