"""Property-based tests (hypothesis) of the online predictor used as a library: rows with extreme but valid values
(0 and `MAX_COUNT` tokens and requests, KV use 0 and 1, every accelerator class and model of the catalog, P/D roles,
time-slice states and any finite stated wait), observations with actuals from the least the poisoning guard keeps
to `MAX_PREDICTED_MS`, long runs of one row, observations of rows never predicted, one at a time and in batches.

- `OnlinePredictor` raises nothing for valid rows and observations, and each of its predictions (mean and upper
  quantile, TTFT and TPOT) is a number > 0, never NaN, at most `MAX_PREDICTED_MS` as served
  (`predictor.client.served`; an overflow is the model's to give, the bound the server's to apply), with the upper
  quantile at least the mean; learning never takes that away;
- an artifact saved and loaded predicts exactly as the predictor it was saved from, saves the same bytes, and
  learns on identically (a learner that does not retrain: the retraining window is not saved, by design);
- learning a batch as Observations or as the `FeatureBatch` of their rows with the actuals beside it ends in the
  same state (learning one at a time ends near it, not at it, as `learn_many`'s docstring says: not tested here);
- `LlmdReference` raises nothing for valid llm-d rows and predicts finite milliseconds ≥ 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from property_search import SEARCH

from leadtime.features.catalog import ACCELERATORS, MODELS
from leadtime.features.rows import (
    MAX_COUNT,
    MAX_PREDICTED_MS,
    MAX_TENSOR_PARALLEL,
    ROLES,
    TIMESLICE_STATES,
    EndpointState,
    FeatureRow,
    Observation,
    RequestFeatures,
    feature_row_to_llmd,
)
from leadtime.predictor.artifact import decode
from leadtime.predictor.client import served
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.llmd_reference import LlmdReference

PROPERTY = settings(SEARCH, max_examples=25)

COUNTS = st.one_of(st.sampled_from((0, 1, 2, 7, 1000, 2**31, MAX_COUNT - 1, MAX_COUNT)), st.integers(0, MAX_COUNT))
SMALL_COUNTS = st.one_of(st.sampled_from((0, 1, 3, 8, 64)), st.integers(0, 5000))
FRACTIONS = st.one_of(st.sampled_from((0.0, 1.0, 0.5, 5e-324, 1.0 - 2**-53)), st.floats(0.0, 1.0))
WAITS_MS = st.one_of(
    st.sampled_from((0.0, 5e-324, 1.0, 80.0, 1e6, MAX_PREDICTED_MS, 1e300, 1.7976931348623157e308)),
    st.floats(0.0, 1e308, allow_nan=False, allow_infinity=False),
)
ORDINARY_WAITS_MS = st.one_of(st.just(0.0), st.floats(0.0, 600_000.0))
ACTUALS_MS = st.one_of(
    st.sampled_from((0.0, 1e-3, 0.05, 1.0, 12.0, 80.0, 5_000.0, 86_400_000.0, MAX_PREDICTED_MS)),
    st.floats(0.0, MAX_PREDICTED_MS, allow_nan=False),
)
ORDINARY_ACTUALS_MS = st.one_of(st.just(0.0), st.floats(1.0, 600_000.0))
ENDPOINTS = ("", "e0", "e1", "e2")


@st.composite
def rows(draw: Any, extreme: bool = True) -> FeatureRow:
    """A valid row: any class of the catalog (or none, the learner's default), any role and time-slice state, and
    counts anywhere up to `MAX_COUNT` (`extreme`) or in an ordinary range."""
    counts = COUNTS if extreme else SMALL_COUNTS
    input_tokens = draw(counts)
    request = RequestFeatures(
        input_tokens=input_tokens,
        prefix_cache_score=draw(FRACTIONS),
        num_tokens_generated=draw(counts),
        encoder_matched_size=draw(counts),
        encoder_input_size=draw(counts),
    )
    state = draw(st.sampled_from(TIMESLICE_STATES))
    endpoint = EndpointState(
        endpoint_id=draw(st.sampled_from(ENDPOINTS)),
        accelerator=draw(st.sampled_from(("", *ACCELERATORS))),
        model=draw(st.sampled_from(("", *MODELS))),
        tensor_parallel=draw(st.sampled_from((1, 2, 8, 16, MAX_TENSOR_PARALLEL))),
        role=draw(st.sampled_from(ROLES)),
        num_request_waiting=draw(counts),
        num_request_running=draw(counts),
        kv_cache_percentage=draw(FRACTIONS),
        prefill_tokens_in_flight=draw(counts),
        decode_tokens_in_flight=draw(counts),
        timeslice_state=state,
        timeslice_wait_ms=draw(WAITS_MS if extreme else ORDINARY_WAITS_MS),
    )
    return FeatureRow(request, endpoint)


@st.composite
def observations(draw: Any, extreme: bool = True) -> Observation:
    """A completed request of a valid row, either actual possibly unobserved (0)."""
    actuals = ACTUALS_MS if extreme else ORDINARY_ACTUALS_MS
    return Observation(draw(rows(extreme)), actual_ttft_ms=draw(actuals), actual_tpot_ms=draw(actuals))


@st.composite
def histories(draw: Any, extreme: bool = True) -> list[Observation]:
    """Observations as a learner meets them: random ones, with long runs of one of them."""
    out: list[Observation] = []
    for _ in range(draw(st.integers(1, 4))):
        obs = draw(observations(extreme))
        out.extend([obs] * draw(st.sampled_from((1, 1, 2, 40, 150))))
    return out


def check_predictions(predictor: OnlinePredictor, probe: Sequence[FeatureRow]) -> dict[str, np.ndarray]:
    """Each prediction of `probe` a number > 0 (never NaN), at most `MAX_PREDICTED_MS` as served, its quantile at
    least its mean; the four arrays by name."""
    p = predictor.predict_many(list(probe))
    out = {name: getattr(p, name) for name in ("ttft_mean", "ttft_quantile", "tpot_mean", "tpot_quantile")}
    for name, values in out.items():
        assert values.shape == (len(probe),), name
        assert not np.isnan(values).any(), (name, values)
        assert (values > 0).all(), (name, values)
        shown = served(values)
        assert np.isfinite(shown).all() and (shown > 0).all() and (shown <= MAX_PREDICTED_MS).all(), (name, shown)
    for target in ("ttft", "tpot"):
        assert (out[f"{target}_quantile"] >= out[f"{target}_mean"]).all(), (target, out)
    return out


def same_but_drifts(one: OnlinePredictor, other: OnlinePredictor) -> bool:
    """Whether both artifacts hold the same state but the count of drifts detected, which a loaded learner counts
    afresh (the drift detector's state is not saved, by design)."""
    states = [decode(p.to_bytes()) for p in (one, other)]
    for state in states:
        for target in state["targets"].values():
            del target["drifts"]
    return states[0] == states[1]


def learner(**kwargs: Any) -> OnlinePredictor:
    """A synchronous learner (`LearnerConfig(background=False)`): the same history, the same state."""
    return OnlinePredictor(LearnerConfig(background=False, **kwargs))


# ----------------------------------------------------------------------------------------------- the learner


@PROPERTY
@given(st.lists(rows(), min_size=1, max_size=6))
def test_a_fresh_predictor_predicts_any_valid_row(probe: list[FeatureRow]) -> None:
    check_predictions(learner(), probe)
    for row in probe:  # one at a time as in a batch
        one = learner().predict_one(row)
        assert all(v > 0 and not math.isnan(v) for v in one.values()), one


@PROPERTY
@given(histories(), st.lists(rows(), min_size=1, max_size=4), st.booleans())
def test_learning_keeps_every_prediction_a_positive_number(
    history: list[Observation], probe: list[FeatureRow], one_at_a_time: bool
) -> None:
    p = learner()
    if one_at_a_time:
        for obs in history:
            p.learn_one(obs)
            check_predictions(p, [obs.row])
    else:
        p.learn_many(history)
    check_predictions(p, [*probe, *(o.row for o in history[:3])])


@PROPERTY
@given(histories(extreme=False), st.lists(rows(extreme=False), min_size=1, max_size=4))
def test_ordinary_rows_predict_finite(history: list[Observation], probe: list[FeatureRow]) -> None:
    p = learner()
    p.learn_many(history)
    for values in check_predictions(p, probe).values():
        assert np.isfinite(values).all(), values  # above MAX_PREDICTED_MS only where it extrapolates far


@PROPERTY
@given(histories(), histories(), st.lists(rows(), min_size=1, max_size=4))
def test_an_artifact_predicts_and_learns_on_as_its_original(
    before: list[Observation], after: list[Observation], probe: list[FeatureRow]
) -> None:
    original = learner(retrain=False)
    original.learn_many(before)
    data = original.to_bytes()
    loaded = OnlinePredictor.from_bytes(data, background=False)
    assert loaded.to_bytes() == data
    expected = check_predictions(original, probe)
    got = check_predictions(loaded, probe)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    for p in (original, loaded):
        for obs in after:
            p.learn_one(obs)
    expected, got = check_predictions(original, probe), check_predictions(loaded, probe)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert same_but_drifts(loaded, original)


@PROPERTY
@given(histories(), st.lists(rows(), min_size=1, max_size=4))
def test_a_batch_learns_as_its_observations(history: list[Observation], probe: list[FeatureRow]) -> None:
    by_observations, by_batch = learner(), learner()
    by_observations.learn_many(history)
    batch = by_batch.vectorizer.batch([o.row for o in history])
    ttft = [o.actual_ttft_ms for o in history]
    tpot = [o.actual_tpot_ms for o in history]
    by_batch.learn_many(batch, ttft, tpot)
    assert by_batch.to_bytes() == by_observations.to_bytes()
    check_predictions(by_batch, probe)


# ----------------------------------------------------------------------------------------------- llm-d's


@settings(PROPERTY, max_examples=8)
@given(st.lists(observations(), min_size=1, max_size=4), st.lists(rows(), min_size=1, max_size=4))
def test_llmd_reference_predicts_finite_milliseconds(seeds: list[Observation], probe: list[FeatureRow]) -> None:
    ref = LlmdReference(model="lightgbm", retrain_every=30, ensemble_min_rows=10)
    training = []
    for i in range(60):
        obs = seeds[i % len(seeds)]
        actuals = {"actual_ttft_ms": obs.actual_ttft_ms, "actual_tpot_ms": obs.actual_tpot_ms}
        training.append({**feature_row_to_llmd(obs.row), **actuals})
    ref.learn_many(training)
    p = ref.predict_many([feature_row_to_llmd(r) for r in probe])
    for name in ("ttft_mean", "ttft_quantile", "tpot_mean", "tpot_quantile"):
        values = getattr(p, name)
        assert values is not None and np.isfinite(values).all() and (values >= 0).all(), (name, values)


def test_a_stated_wait_near_a_doubles_limit_is_learned_without_a_warning() -> None:
    """A row may state any finite wait; its observation's TTFT less the wait, times 100 (the poisoning guard's
    factor), overflowed to -inf: right for the test, but numpy warned "overflow encountered in multiply" at every
    such batch, an error where warnings are (`-W error`, `np.seterr(over="raise")`)."""
    parked = EndpointState(timeslice_state="parked", timeslice_wait_ms=1.7976931348623157e308)
    row = FeatureRow(RequestFeatures(100), parked)
    p = learner()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.learn_many([Observation(row, actual_ttft_ms=80.0, actual_tpot_ms=12.0)])
    assert p.status()["observations"] == {"ttft": 0, "tpot": 1}  # its TTFT, sooner than the wait, is not learned


def test_a_loaded_learner_keeps_its_corrections_upkeep_on_schedule() -> None:
    """The online correction tidies its covariance every 256 rows (`RecursiveLeastSquares._after_update`); a loaded
    one counted those rows from 0, so it tidied at other rows than the learner it was saved from, and the two
    predicted apart from then on (by the last bits at first)."""
    rng = np.random.default_rng(0)

    def observation() -> Observation:
        endpoint = EndpointState(num_request_running=int(rng.integers(0, 30)), num_request_waiting=int(rng.integers(5)))
        row = FeatureRow(RequestFeatures(int(rng.integers(10, 4000))), endpoint)
        return Observation(row, actual_ttft_ms=float(rng.uniform(20, 400)), actual_tpot_ms=float(rng.uniform(8, 40)))

    original = learner(retrain=False)
    for _ in range(200):
        original.learn_one(observation())
    loaded = OnlinePredictor.from_bytes(original.to_bytes(), background=False)
    later = [observation() for _ in range(300)]
    for p in (original, loaded):
        for obs in later:
            p.learn_one(obs)
    probe = [o.row for o in later[:5]]
    expected, got = original.predict_many(probe), loaded.predict_many(probe)
    np.testing.assert_array_equal(got.ttft_mean, expected.ttft_mean)
    np.testing.assert_array_equal(got.tpot_mean, expected.tpot_mean)
    assert same_but_drifts(loaded, original)
