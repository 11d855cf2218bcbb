"""The online predictor: cold start, convergence, per-endpoint tracking, calibration, retraining, safety."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from leadtime.features.errors import FeatureError
from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
from leadtime.features.vectorize import COLUMN_INDEX, FeatureBatch, Vectorizer
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.physics import MIN_MS, TARGETS, correction_features, prior_ms
from leadtime.predictor.target import _Adwin, log_target, new_drift_detector, tree_inputs


def _row(rng: np.random.Generator, endpoint: str = "", accelerator: str = "") -> FeatureRow:
    return FeatureRow(
        RequestFeatures(input_tokens=int(rng.integers(10, 2000))),
        EndpointState(
            endpoint_id=endpoint,
            accelerator=accelerator,
            num_request_waiting=int(rng.integers(0, 6)),
            num_request_running=int(rng.integers(0, 40)),
            kv_cache_percentage=float(rng.uniform(0, 0.8)),
            prefill_tokens_in_flight=int(rng.integers(0, 4000)),
        ),
    )


def _truth(row: FeatureRow) -> tuple[float, float]:
    """A synthetic fleet whose latency is linear in the load features (llm-d's own test shape)."""
    r, e = row.request, row.endpoint
    ttft = 30 + 0.05 * r.input_tokens + 40 * e.num_request_waiting + 0.01 * e.prefill_tokens_in_flight
    tpot = 8 + 0.15 * e.num_request_running + 6 * e.kv_cache_percentage
    return ttft, tpot


@pytest.fixture
def predictor() -> Iterator[OnlinePredictor]:
    p = OnlinePredictor(LearnerConfig(background=False, retrain_every=1000))
    yield p
    p.close()


def test_predicts_from_the_first_row_with_a_physics_prior(predictor: OnlinePredictor) -> None:
    small = FeatureRow(RequestFeatures(100), EndpointState())
    big = FeatureRow(RequestFeatures(8000), EndpointState(num_request_waiting=5, prefill_tokens_in_flight=20000))
    p_small, p_big = predictor.predict_one(small), predictor.predict_one(big)
    assert 0 < p_small["ttft_mean"] < p_big["ttft_mean"]
    assert p_small["tpot_mean"] > 0
    # Cold start: not a constant — the prior scales with the work the request brings.
    assert p_big["ttft_mean"] > 5 * p_small["ttft_mean"]


def test_cold_start_scales_with_accelerator_class(predictor: OnlinePredictor) -> None:
    row = FeatureRow(RequestFeatures(2000), EndpointState(accelerator="h100-sxm", num_request_running=10))
    slow = FeatureRow(RequestFeatures(2000), EndpointState(accelerator="l40s", num_request_running=10))
    fast, slower = predictor.predict_one(row), predictor.predict_one(slow)
    assert slower["tpot_mean"] > 2.5 * fast["tpot_mean"]  # 3.0 vs 0.72 TB/s measured KV-read bandwidth
    assert slower["ttft_mean"] > 2.0 * fast["ttft_mean"]  # 881 vs 252 TFLOP/s measured GEMM


def test_converges_on_a_known_function(predictor: OnlinePredictor) -> None:
    rng = np.random.default_rng(1)
    rows = [_row(rng) for _ in range(3000)]
    truth = np.array([_truth(r) for r in rows])
    noise = rng.lognormal(0, 0.05, size=truth.shape)
    x = predictor.vectorizer.batch(rows)
    predictor.learn_many(x[:2500], truth[:2500, 0] * noise[:2500, 0], truth[:2500, 1] * noise[:2500, 1])
    p = predictor.predict_many(x[2500:])
    ttft_mape = np.mean(np.abs(p.ttft_mean - truth[2500:, 0]) / truth[2500:, 0])
    tpot_mape = np.mean(np.abs(p.tpot_mean - truth[2500:, 1]) / truth[2500:, 1])
    assert ttft_mape < 0.15
    assert tpot_mape < 0.05


def test_p90_is_calibrated_and_within_15_percent_of_the_true_p90(predictor: OnlinePredictor) -> None:
    """llm-d's own acceptance check: ≥70% of p90 predictions within ±15% of the true p90, coverage 90±5."""
    rng = np.random.default_rng(2)
    sigma = 0.2
    rows = [_row(rng) for _ in range(4000)]
    truth = np.array([_truth(r) for r in rows])
    observed = truth * rng.lognormal(0, sigma, size=truth.shape)
    x = predictor.vectorizer.batch(rows)
    predictor.learn_many(x[:3000], observed[:3000, 0], observed[:3000, 1])
    p = predictor.predict_many(x[3000:])
    true_p90 = truth[3000:, 0] * np.exp(1.2816 * sigma)
    within = np.abs(p.ttft_quantile - true_p90) / true_p90 <= 0.15
    coverage = np.mean(observed[3000:, 0] <= p.ttft_quantile)
    assert within.mean() >= 0.70
    assert 0.85 <= coverage <= 0.95


def test_p90_coverage_holds_while_latency_climbs_in_steps(predictor: OnlinePredictor) -> None:
    """A queue that keeps growing: every 100 requests latency steps up by 10%. The calibration is settled in
    batches; judged against the adaptive term as it moved within a batch, each step looked covered after a few
    misses while what had been served kept missing (coverage 0.78)."""
    rng = np.random.default_rng(7)
    n = 3000
    rows = [
        FeatureRow(RequestFeatures(int(rng.integers(500, 600))), EndpointState(num_request_running=10))
        for _ in range(n)
    ]
    x = predictor.vectorizer.batch(rows)
    ttft = 200.0 * np.exp(0.1 * (np.arange(n) // 100)) * rng.lognormal(0, 0.02, n)
    covered = []
    for i in range(n):
        covered.append(ttft[i] <= predictor.predict_many(x[i : i + 1]).ttft_quantile[0])
        predictor.learn_many(x[i : i + 1], ttft[i : i + 1], np.zeros(1))
    assert 0.85 <= np.mean(covered[500:]) <= 0.95


def test_p90_coverage_does_not_depend_on_the_batch_size_learned_in() -> None:
    """Regression: a batch was settled against the one calibration that stood before it, with the adaptive term
    stepped once per row, so 5,000 rows learned in one call drove it to -4.7 and the p90 onto the mean
    (coverage 0.48; learned 64 at a time, 0.98). A replica without the training lease, as here, never
    recalibrates at a retrain; the service takes up to 100,000 observations per call. (Learned 64 at a time, the
    coverage on fresh rows is 0.84 to 0.95 across seeds of this stream: the bound on it is that wide.)"""
    rng = np.random.default_rng(9)
    rows = [_row(rng, endpoint=f"e{i % 4}") for i in range(6000)]
    truth = np.array([_truth(r) for r in rows])
    observed = truth * rng.lognormal(0, 0.1, size=truth.shape)
    coverage = {}
    for size in (64, 5000):
        p = OnlinePredictor(LearnerConfig(background=False, retrain=False))
        x = p.vectorizer.batch(rows)
        for start in range(0, 5000, size):
            stop = min(start + size, 5000)
            p.learn_many(x[start:stop], observed[start:stop, 0], observed[start:stop, 1])
        served = p.predict_many(x[5000:])
        coverage[size] = np.array(
            [np.mean(observed[5000:, 0] <= served.ttft_quantile), np.mean(observed[5000:, 1] <= served.tpot_quantile)]
        )
    assert np.all(np.abs(coverage[5000] - coverage[64]) <= 0.03), coverage
    assert np.all(np.abs(coverage[5000] - 0.9) <= 0.06), coverage


def test_p90_stays_calibrated_when_every_sample_shares_one_load_regime(predictor: OnlinePredictor) -> None:
    """llm-d's stress case: all samples in one regime (its bucketed window keeps only 500 and fails)."""
    rng = np.random.default_rng(3)
    rows = [
        FeatureRow(
            RequestFeatures(int(rng.integers(500, 520))),
            EndpointState(num_request_waiting=2, num_request_running=20, kv_cache_percentage=0.5),
        )
        for _ in range(3000)
    ]
    observed = 120 * rng.lognormal(0, 0.25, size=3000)
    x = predictor.vectorizer.batch(rows)
    predictor.learn_many(x[:2000], observed[:2000], np.zeros(2000))
    p = predictor.predict_many(x[2000:])
    coverage = np.mean(observed[2000:] <= p.ttft_quantile)
    assert 0.85 <= coverage <= 0.95


def test_a_slowed_endpoint_is_tracked_within_tens_of_observations(predictor: OnlinePredictor) -> None:
    rng = np.random.default_rng(4)
    endpoints = [f"ep-{i}" for i in range(8)]
    for i in range(2000):
        row = _row(rng, endpoint=endpoints[i % 8])
        ttft, tpot = _truth(row)
        predictor.learn_one(Observation(row, actual_ttft_ms=ttft, actual_tpot_ms=tpot))
    # ep-3 becomes 2x slower (thermal throttling); only its own observations say so.
    errors = []
    for _ in range(60):
        row = _row(rng, endpoint="ep-3")
        ttft, tpot = _truth(row)
        predicted = predictor.predict_one(row)["tpot_mean"]
        errors.append(abs(predicted - 2 * tpot) / (2 * tpot))
        predictor.learn_one(Observation(row, actual_ttft_ms=2 * ttft, actual_tpot_ms=2 * tpot))
    assert np.mean(errors[:5]) > 0.3  # it really was surprised at first
    assert np.mean(errors[-10:]) < 0.12  # and caught up within tens of observations
    other = _row(rng, endpoint="ep-5")
    assert abs(predictor.predict_one(other)["tpot_mean"] - _truth(other)[1]) / _truth(other)[1] < 0.2


def test_rejected_input_leaves_state_unchanged(predictor: OnlinePredictor) -> None:
    rng = np.random.default_rng(5)
    rows = [_row(rng) for _ in range(200)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    predictor.learn_many(x, truth[:, 0], truth[:, 1])
    before = predictor.to_bytes()
    bad = x[:10]
    bad.X = bad.X.copy()
    bad.X[7, COLUMN_INDEX["kv_cache_percentage"]] = np.nan
    with pytest.raises(FeatureError, match="kv_cache_percentage"):
        predictor.learn_many(bad, truth[:10, 0], truth[:10, 1])
    with pytest.raises(FeatureError, match="actual_ttft_ms"):
        predictor.learn_many(x[:10], np.r_[truth[:9, 0], -1.0], truth[:10, 1])
    with pytest.raises(FeatureError, match="num_request_waiting"):
        bad = x[:3]
        bad.X = bad.X.copy()
        bad.X[1, COLUMN_INDEX["num_request_waiting"]] = -2
        predictor.learn_many(bad, truth[:3, 0], truth[:3, 1])
    assert predictor.to_bytes() == before
    assert predictor.status()["observations"] == {"ttft": 200, "tpot": 200}


def test_zero_actual_means_target_not_observed(predictor: OnlinePredictor) -> None:
    rng = np.random.default_rng(6)
    rows = [_row(rng) for _ in range(50)]
    x = predictor.vectorizer.batch(rows)
    predictor.learn_many(x, np.full(50, 100.0), np.zeros(50))
    assert predictor.status()["observations"] == {"ttft": 50, "tpot": 0}


def _threshold_data(seed: int, n: int) -> tuple[OnlinePredictor, FeatureBatch, np.ndarray, np.ndarray]:
    """A fresh synchronous learner and rows with a threshold effect the log-linear correction cannot express:
    above 2 waiting requests TTFT triples. Returns (predictor, x, ttft, tpot)."""
    rng = np.random.default_rng(seed)
    predictor = OnlinePredictor(LearnerConfig(background=False, retrain_every=10**6, min_window=100))
    rows = [_row(rng) for _ in range(n)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    waiting = x.X[:, COLUMN_INDEX["num_request_waiting"]]
    ttft = truth[:, 0] * np.where(waiting > 2, 3.0, 1.0) * rng.lognormal(0, 0.05, n)
    return predictor, x, ttft, truth[:, 1]


def test_retrain_swaps_trees_in_only_when_they_win() -> None:
    predictor, x, ttft, tpot = _threshold_data(7, 3000)
    results: list[dict] = []
    predictor.add_retrain_listener(results.append)
    predictor.learn_many(x, ttft, tpot)  # the jump at waiting > 2 may also trigger a drift retrain
    predictor.retrain_now()
    accepted = [r["ttft"] for r in results if r["ttft"]["accepted_mean"]]
    assert accepted, "the threshold effect should have made a tree win"
    assert accepted[0]["heldout_ape_after"] < accepted[0]["heldout_ape_before"]
    # A second retrain on the same data finds nothing better: nothing is swapped, the version stays.
    assert not results[-1]["ttft"]["accepted_mean"]
    assert predictor.version == len(
        [
            r
            for r in results
            if r["ttft"]["accepted_mean"]
            or r["ttft"]["accepted_upper"]
            or r["tpot"]["accepted_mean"]
            or r["tpot"]["accepted_upper"]
        ]
    )
    text = predictor.tree_text("ttft")
    assert text is not None and text.startswith("tree")
    importances = predictor.tree_importances("ttft")
    assert max(importances.items(), key=lambda item: item[1])[0] == "num_request_waiting"
    predictor.close()


def test_drift_triggers_a_background_retrain() -> None:
    rng = np.random.default_rng(8)
    predictor = OnlinePredictor(LearnerConfig(background=True, retrain_every=10**6, min_window=100)).start()
    seen: list[dict] = []
    predictor.add_retrain_listener(seen.append)
    rows = [_row(rng) for _ in range(1500)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    predictor.learn_many(x[:1000], truth[:1000, 0], truth[:1000, 1])
    predictor.learn_many(x[1000:], truth[1000:, 0] * 4.0, truth[1000:, 1] * 4.0)  # the fleet got 4x slower
    import time

    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    predictor.close()
    assert predictor.status()["drifts"]["ttft"] + predictor.status()["drifts"]["tpot"] >= 1
    assert seen, "a drift should have woken the background retrain"


def test_quantile_is_never_below_the_mean(predictor: OnlinePredictor) -> None:
    rng = np.random.default_rng(9)
    rows = [_row(rng) for _ in range(500)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    predictor.learn_many(x, truth[:, 0], truth[:, 1])
    p = predictor.predict_many(x)
    assert (p.ttft_quantile >= p.ttft_mean).all()
    assert (p.tpot_quantile >= p.tpot_mean).all()


def test_timeslice_wait_adds_to_ttft(predictor: OnlinePredictor) -> None:
    resident = FeatureRow(RequestFeatures(500), EndpointState(timeslice_state="resident"))
    parked = FeatureRow(RequestFeatures(500), EndpointState(timeslice_state="parked", timeslice_wait_ms=1500.0))
    assert predictor.predict_one(parked)["ttft_mean"] >= predictor.predict_one(resident)["ttft_mean"] + 1400


def test_a_time_slice_state_never_learned_leaves_the_prediction_where_it_was(predictor: OnlinePredictor) -> None:
    """Learned on resident rows only, a row switched out or parked with no stated wait is predicted as the
    resident one: nothing was learned about those states. (Its correction column was 1 on every resident row, the
    same as the bias, so the two shared the learned intercept and a switching row lost half of it: ~43% faster.)"""
    rng = np.random.default_rng(5)
    rows = [_row(rng) for _ in range(2000)]
    predictor.learn_many([Observation(r, *_truth(r)) for r in rows])
    probe = _row(rng)
    resident = predictor.predict_one(probe)
    for state in ("switching", "parked"):
        away = predictor.predict_one(FeatureRow(probe.request, replace(probe.endpoint, timeslice_state=state)))
        for name in ("ttft_mean", "tpot_mean"):
            assert away[name] == pytest.approx(resident[name], rel=0.03), (state, name)


def test_a_first_token_sooner_than_its_stated_wait_teaches_the_correction_nothing(predictor: OnlinePredictor) -> None:
    """A stated time-slice wait is an expectation of when the accelerator comes back, and can be longer than the
    real one. Such a row says nothing of the correction: learned as its TTFT less the wait, floored at 0.05 ms, it
    was ~500x faster than the prior, and 300 of them among 300 ordinary rows took an ordinary probe from 199.6 to
    90.5 ms."""
    rng = np.random.default_rng(7)
    ordinary = [Observation(r, *_truth(r)) for r in (_row(rng, endpoint=f"e{i % 4}") for i in range(2300))]
    predictor.learn_many(ordinary[:2000])
    probe = FeatureRow(RequestFeatures(1000), EndpointState(endpoint_id="e1", num_request_waiting=5))
    before = predictor.predict_one(probe)["ttft_mean"]
    overstated = [
        Observation(
            FeatureRow(
                RequestFeatures(1000),
                EndpointState(
                    endpoint_id=f"e{i % 4}", num_request_waiting=5, timeslice_state="parked", timeslice_wait_ms=5000.0
                ),
            ),
            actual_ttft_ms=4000.0,
            actual_tpot_ms=12.0,
        )
        for i in range(300)
    ]
    predictor.learn_many([o for pair in zip(overstated, ordinary[2000:], strict=True) for o in pair])
    assert predictor.predict_one(probe)["ttft_mean"] == pytest.approx(before, rel=0.05)
    assert predictor.status()["observations"] == {"ttft": 2300, "tpot": 2600}  # their TPOT is a measurement
    assert predictor.status()["implausible"] == 0


def test_the_correction_the_trees_and_the_log_target_floor_the_prior_alike() -> None:
    """A prior below the floor (only absurd hardware has one: an H100 at tensor parallelism 1024) is floored at one
    value for the correction's log_prior, the trees' and the log target (the correction floored it at 1e-3 ms, the
    others at 0.05 ms)."""
    x = Vectorizer().batch([FeatureRow(RequestFeatures(1000), EndpointState(tensor_parallel=1024))]).X
    for target in TARGETS:
        prior = prior_ms(target, x)
        assert prior[0] < MIN_MS
        log_prior = correction_features(target, x, prior)[0, 1] + np.log(10.0)  # φ's log_prior is of prior / 10
        assert log_prior == pytest.approx(tree_inputs(x, prior)[0, -1]) == pytest.approx(np.log(MIN_MS))
        assert log_target(target, x, np.array([1.0]), prior)[0] == pytest.approx(-np.log(MIN_MS))


def test_debug_one_explains_every_term(predictor: OnlinePredictor) -> None:
    row = FeatureRow(RequestFeatures(500), EndpointState(endpoint_id="ep-1", num_request_running=4))
    text = predictor.debug_one(row)
    for term in ("physics prior", "online correction", "endpoint offset", "tree residual", "calibration offset"):
        assert term in text
    assert text.startswith("ttft:")


def test_predict_many_refuses_a_matrix_of_the_wrong_width(predictor: OnlinePredictor) -> None:
    with pytest.raises(ValueError, match="shape"):
        predictor.predict_many(np.zeros((3, 5)))


def test_a_learner_told_not_to_retrain_never_does_even_on_drift() -> None:
    rng = np.random.default_rng(12)
    predictor = OnlinePredictor(LearnerConfig(background=False, retrain_every=100, min_window=100, retrain=False))
    seen: list[dict] = []
    predictor.add_retrain_listener(seen.append)
    rows = [_row(rng) for _ in range(1200)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    predictor.learn_many(x[:600], truth[:600, 0], truth[:600, 1])
    predictor.learn_many(x[600:], truth[600:, 0] * 4.0, truth[600:, 1] * 4.0)
    assert predictor.status()["drifts"]["ttft"] + predictor.status()["drifts"]["tpot"] >= 1
    assert seen == []
    assert predictor.status()["observations"]["ttft"] == 1200  # it still learned every row online


def test_a_failing_background_retrain_is_recorded_and_the_thread_lives_on(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(13)
    predictor = OnlinePredictor(LearnerConfig(background=True, retrain_every=200, min_window=100)).start()
    calls: list[int] = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("LightGBM exploded")

    import leadtime.predictor.target as target_module

    monkeypatch.setattr(target_module, "fit_booster", broken)
    rows = [_row(rng) for _ in range(1000)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    import time

    predictor.learn_many(x[:400], truth[:400, 0], truth[:400, 1])
    deadline = time.monotonic() + 20
    while predictor.status()["retrain_error"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "LightGBM exploded" in (predictor.status()["retrain_error"] or "")
    assert predictor.retrain_failures >= 1  # counted, for the service's metrics
    first = len(calls)
    predictor.learn_many(x[400:], truth[400:, 0], truth[400:, 1])  # the next trigger is served again
    deadline = time.monotonic() + 20
    while len(calls) == first and time.monotonic() < deadline:
        time.sleep(0.05)
    predictor.close()
    assert len(calls) > first
    assert predictor.status()["observations"]["ttft"] == 1000


def test_a_cold_p90_is_wider_than_the_mean_and_narrows_as_residuals_arrive(predictor: OnlinePredictor) -> None:
    row = FeatureRow(RequestFeatures(300), EndpointState(num_request_running=3))
    cold = predictor.predict_one(row)
    assert cold["ttft_quantile"] >= 1.9 * cold["ttft_mean"]
    rng = np.random.default_rng(14)
    rows = [_row(rng) for _ in range(400)]
    x = predictor.vectorizer.batch(rows)
    truth = np.array([_truth(r) for r in rows])
    predictor.learn_many(x, truth[:, 0] * rng.lognormal(0, 0.05, 400), truth[:, 1])
    warm = predictor.predict_one(row)
    assert warm["ttft_quantile"] < 1.3 * warm["ttft_mean"]  # low-noise data: a narrow band once learned


def test_the_sample_window_keeps_the_newest_rows_in_order_across_wraparound() -> None:
    from leadtime.predictor.target import SampleWindow

    window = SampleWindow(capacity=100)
    width = window.x.shape[1]
    for start, n in ((0, 30), (30, 90), (120, 250)):  # fill, wrap around, then overflow in one batch
        rows = np.arange(start, start + n, dtype=float)
        window.extend(
            np.repeat(rows[:, None], width, axis=1), rows, [f"c{int(r)}" for r in rows], [f"e{int(r)}" for r in rows]
        )
    x, z, classes, endpoints = window.chronological()
    assert window.count == 100
    np.testing.assert_array_equal(z, np.arange(270, 370, dtype=float))
    np.testing.assert_array_equal(x[:, 0], z)
    assert classes[0] == "c270" and endpoints[-1] == "e369"


def test_loading_again_reuses_boosters_whose_text_did_not_change() -> None:
    """The service reloads its learner's snapshot several times a second: unchanged trees are not re-parsed."""
    predictor, x, ttft, tpot = _threshold_data(11, 1500)
    predictor.learn_many(x[:1000], ttft[:1000], tpot[:1000])
    predictor.retrain_now()
    first = OnlinePredictor.from_bytes(predictor.to_bytes(), background=False)
    assert first._models["ttft"].trees.mean is not None
    predictor.config.retrain = False  # the online parts learn, the trees stay
    predictor.learn_many(x[1000:1100], ttft[1000:1100], tpot[1000:1100])
    again = OnlinePredictor.from_bytes(predictor.to_bytes(), background=False, reuse=first)
    assert again._models["ttft"].trees.mean is first._models["ttft"].trees.mean
    np.testing.assert_allclose(again.predict_many(x[:50]).ttft_mean, predictor.predict_many(x[:50]).ttft_mean)
    predictor.config.retrain = True
    predictor.learn_many(x[1100:], ttft[1100:] * 5.0, tpot[1100:])
    predictor.retrain_now()  # new trees: loaded afresh, never confused with the old ones
    changed = OnlinePredictor.from_bytes(predictor.to_bytes(), background=False, reuse=again)
    if predictor.tree_text("ttft") != first.tree_text("ttft"):
        assert changed._models["ttft"].trees.mean is not first._models["ttft"].trees.mean
    np.testing.assert_allclose(changed.predict_many(x[:50]).ttft_mean, predictor.predict_many(x[:50]).ttft_mean)
    for p in (predictor, first, again, changed):
        p.close()


# --- the interface: river's one/many forms on the same row type -------------------------------------------


def _observations(n: int, seed: int = 21) -> list[Observation]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        row = _row(rng, endpoint=f"e{i % 4}", accelerator=["", "l40s"][i % 2])
        ttft, tpot = _truth(row)
        out.append(Observation(row, actual_ttft_ms=ttft, actual_tpot_ms=tpot if i % 3 else 0.0))
    return out


def test_the_one_and_many_forms_agree_on_rows_and_batches() -> None:
    observations = _observations(120)
    rows = [o.row for o in observations]
    by_list = OnlinePredictor(LearnerConfig(background=False))
    by_list.learn_many(observations)
    by_batch = OnlinePredictor(LearnerConfig(background=False))
    batch = by_batch.vectorizer.batch(rows)
    by_batch.learn_many(batch, [o.actual_ttft_ms for o in observations], [o.actual_tpot_ms for o in observations])
    assert by_list.to_bytes() == by_batch.to_bytes()
    from_rows, from_batch = by_list.predict_many(rows), by_list.predict_many(batch)
    for name in ("ttft_mean", "ttft_quantile", "tpot_mean", "tpot_quantile"):
        np.testing.assert_array_equal(getattr(from_rows, name), getattr(from_batch, name))
        one = [by_list.predict_one(r)[name] for r in rows[:5]]
        np.testing.assert_allclose(one, getattr(from_rows, name)[:5], rtol=1e-12)  # BLAS may round alone rows apart
    one_by_one = OnlinePredictor(LearnerConfig(background=False))
    for obs in observations[:40]:
        one_by_one.learn_one(obs)
    assert one_by_one.status()["observations"] == {"ttft": 40, "tpot": 26}


def test_learn_many_says_what_a_batch_needs() -> None:
    p = OnlinePredictor(LearnerConfig(background=False))
    batch = p.vectorizer.batch([o.row for o in _observations(3)])
    with pytest.raises(TypeError, match="needs its actuals"):
        p.learn_many(batch)
    with pytest.raises(TypeError, match="carry their own actuals"):
        p.learn_many(_observations(3), [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    with pytest.raises(FeatureError, match="expected 3 values"):
        p.learn_many(batch, [1.0], [1.0])
    p.learn_many([])  # nothing to learn is fine
    assert p.status()["observations"] == {"ttft": 0, "tpot": 0}


def test_a_bare_matrix_learns_and_predicts_as_its_rows() -> None:
    observations = _observations(60)
    by_rows = OnlinePredictor(LearnerConfig(background=False))
    by_matrix = OnlinePredictor(LearnerConfig(background=False))
    rows = [FeatureRow(o.row.request, replace(o.row.endpoint, endpoint_id="")) for o in observations]
    x = by_matrix.vectorizer.transform(rows)  # a matrix names no endpoints: learn the rows without them too
    by_rows.learn_many(
        [Observation(r, o.actual_ttft_ms, o.actual_tpot_ms) for r, o in zip(rows, observations, strict=True)]
    )
    by_matrix.learn_many(x, [o.actual_ttft_ms for o in observations], [o.actual_tpot_ms for o in observations])
    assert by_rows.to_bytes() == by_matrix.to_bytes()
    np.testing.assert_array_equal(by_rows.predict_many(rows).ttft_mean, by_matrix.predict_many(x).ttft_mean)
    bad = x.copy()
    bad[0, COLUMN_INDEX["accel_tb_s"]] *= 1.5
    with pytest.raises(ValueError, match="no accelerator class"):
        by_matrix.predict_many(bad)


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("num_request_waiting", np.nan),
        ("num_request_running", -50.0),
        ("kv_cache_percentage", 7.0),
        ("uncached_tokens", -1e6),
    ],
)
def test_predict_many_refuses_a_bad_matrix_or_batch_it_did_not_vectorize_naming_the_column(
    predictor: OnlinePredictor, column: str, value: float
) -> None:
    """Regression: a bare matrix or a FeatureBatch built by hand was predicted unchecked: NaN waiting, negative
    running, kv 7.0 or a negative uncached count came back as NaN predictions and a numpy RuntimeWarning, where
    learn_many named the column."""
    batch = predictor.vectorizer.batch([FeatureRow(RequestFeatures(1000), EndpointState(num_request_waiting=2))] * 4)
    bad = batch.X.copy()
    bad[2, COLUMN_INDEX[column]] = value
    with pytest.raises(FeatureError, match=f"^{column}: row 2 is"):
        predictor.predict_many(bad)
    with pytest.raises(FeatureError, match=f"^{column}: row 2 is"):
        predictor.predict_many(FeatureBatch(bad, batch.hardware, batch.table))


def test_a_batch_the_vectorizer_made_is_not_checked_again(
    predictor: OnlinePredictor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rows were checked when they were built (or decoded): checking the matrix again would cost the router's
    decisions ~7 µs on a 32-row batch of ~27 µs. Its slices and concatenations are the Vectorizer's too."""
    rows = [o.row for o in _observations(8)]
    batch = predictor.vectorizer.batch(rows)
    expected = predictor.predict_many(batch).ttft_mean

    def refuse(x: np.ndarray) -> np.ndarray:
        raise AssertionError("checked again")

    monkeypatch.setattr("leadtime.predictor.learner.check_matrix", refuse)
    np.testing.assert_array_equal(predictor.predict_many(rows).ttft_mean, expected)
    np.testing.assert_array_equal(predictor.predict_many(batch).ttft_mean, expected)
    joined = FeatureBatch.concat([batch[:3], batch[3:]])
    np.testing.assert_array_equal(predictor.predict_many(joined).ttft_mean, expected)
    with pytest.raises(AssertionError, match="checked again"):
        predictor.predict_many(FeatureBatch(batch.X, batch.hardware, batch.table))


def test_an_iterator_or_actuals_that_are_not_numbers_are_errors_naming_the_argument(
    predictor: OnlinePredictor,
) -> None:
    """Regression: a generator was "object of type 'generator' has no len()", actuals of strings a bare "could not
    convert string to float: 'a'", and a NaN was quoted as np.float64(nan)."""
    observations = _observations(3)
    rows = [o.row for o in observations]
    with pytest.raises(TypeError, match="predict_many takes a sequence of FeatureRows.*got a generator"):
        predictor.predict_many(r for r in rows)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="learn_many takes a sequence of Observations.*got a generator"):
        predictor.learn_many(o for o in observations)  # type: ignore[arg-type]
    x = predictor.vectorizer.transform(rows)
    with pytest.raises(FeatureError, match="^actual_ttft_ms: must hold numbers only"):
        predictor.learn_many(x, ["a"] * 3, [1.0] * 3)  # type: ignore[list-item]
    with pytest.raises(FeatureError, match=r"^actual_tpot_ms: row 1 is nan; must be"):
        predictor.learn_many(x, [1.0] * 3, [1.0, np.nan, 1.0])
    x[0, COLUMN_INDEX["num_request_waiting"]] = np.nan
    with pytest.raises(FeatureError, match=r"^num_request_waiting: row 0 is nan; NaN and infinities are refused"):
        predictor.predict_many(x)
    assert predictor.status()["observations"] == {"ttft": 0, "tpot": 0}


def test_constructing_a_predictor_starts_no_thread() -> None:
    import threading

    before = {t.name for t in threading.enumerate()}
    p = OnlinePredictor(LearnerConfig(background=True))
    assert "leadtime-retrain" not in {t.name for t in threading.enumerate()} - before
    loaded = OnlinePredictor.from_bytes(p.to_bytes(), background=True)
    assert "leadtime-retrain" not in {t.name for t in threading.enumerate()} - before
    with loaded:  # `with` starts and stops the background work
        assert "leadtime-retrain" in {t.name for t in threading.enumerate()}
    assert p.start() is p
    p.close()
    assert "leadtime-retrain" not in {t.name for t in threading.enumerate()} - before


def test_one_observation_of_one_class_barely_moves_another_classs_predictions() -> None:
    # Regression: one h100-sxm/llama-3.1-8b row 3x slower than the prior moved an h200-sxm/qwen3-32b prediction
    # x2.94 through the global correction, whose pull towards the prior (a ridge of 1) weighed nothing.
    p = OnlinePredictor(LearnerConfig(background=False))
    other = FeatureRow(RequestFeatures(1000), EndpointState(accelerator="h200-sxm", model="qwen3-32b"))
    seen = FeatureRow(RequestFeatures(1000), EndpointState(num_request_running=4))
    before, cold = p.predict_one(other), p.predict_one(seen)
    slow = Observation(seen, actual_ttft_ms=3 * cold["ttft_mean"], actual_tpot_ms=3 * cold["tpot_mean"])
    p.learn_one(slow)
    after = p.predict_one(other)
    for target in ("ttft_mean", "tpot_mean"):
        assert 1.0 < after[target] / before[target] < 1.3, target
    # What keeps coming is still learned: the seen class is most of the way to x3 within a hundred observations.
    for _ in range(99):
        p.learn_one(slow)
    warm = p.predict_one(seen)
    assert warm["ttft_mean"] > 2.4 * cold["ttft_mean"] and warm["tpot_mean"] > 2.4 * cold["tpot_mean"]


def _ramp_rows(n: int, seed: int = 0) -> tuple:
    """A load ramp whose TTFT saturates (a client timeout caps it): the prior keeps growing with the queue, so
    log(actual / prior) depends on the queue in a way the log-linear correction cannot follow everywhere."""
    from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
    from leadtime.features.vectorize import Vectorizer

    rng = np.random.default_rng(seed)
    rows, actual = [], []
    for i in range(n):
        waiting = int(400 * i / (0.7 * n)) if i < 0.7 * n else 0  # the ramp, then the queue drained
        prompt = int(rng.integers(2000, 9000))
        rows.append(
            FeatureRow(
                RequestFeatures(prompt),
                EndpointState(
                    num_request_waiting=waiting, num_request_running=30, prefill_tokens_in_flight=waiting * 5000
                ),
            )
        )
        actual.append(min(600.0 + 900.0 * waiting, 60_000.0) * float(np.exp(rng.normal(0, 0.05))))
    return Vectorizer("h200-sxm", "qwen3-32b").batch(rows).X, np.array(actual)


def test_trees_are_accepted_when_the_load_moved_and_serve_every_load_state_met() -> None:
    # Held out as the newest fifth of the window, the drained queue at the end of a ramp refused every tree,
    # and rows from the ramp's middle were predicted from the drained state (10x off).
    x, ttft = _ramp_rows(2000)
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False, retrain=False)
    predictor = OnlinePredictor(config)
    predictor.learn_many(x, ttft, np.zeros(len(x)))
    online_only = predictor.predict_many(x).ttft_mean
    result = predictor.retrain_now()
    assert result["ttft"]["accepted_mean"]
    refined = predictor.predict_many(x).ttft_mean
    ape = lambda p: float(np.mean(np.abs(p - ttft) / ttft))  # noqa: E731
    assert ape(refined) < 0.5 * ape(online_only)


def test_a_kept_quantile_tree_is_recalibrated_at_each_retrain() -> None:
    """The quantile tree's shift belongs to the online parts it was fitted beside; when a retrain keeps the tree
    its shift is fitted again on the window, so a stale one does not carry on."""
    x, ttft = _ramp_rows(2000)
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False, retrain=False)
    predictor = OnlinePredictor(config)
    predictor.learn_many(x, ttft, np.zeros(len(x)))
    assert predictor.retrain_now()["ttft"]["accepted_upper"]
    model = predictor._models["ttft"]
    model.upper_shift -= 5.0  # as if the online parts had moved far since the tree was fitted
    stale = float(np.mean(ttft <= predictor.predict_many(x).ttft_quantile))
    again = predictor.retrain_now()["ttft"]
    assert not again["accepted_upper"]  # the same window and seed fit the same tree: it is kept
    coverage = float(np.mean(ttft <= predictor.predict_many(x).ttft_quantile))
    assert stale < 0.7
    assert 0.85 <= coverage <= 0.97


def _installed(
    predictor: OnlinePredictor, x: np.ndarray, residual: float, kind: str = "mean", base: float = 0.0
) -> None:
    """Serve a tree fitted elsewhere that puts every TTFT prediction's mean (`kind` "mean") or upper quantile
    ("upper") at `residual` (log) above the online parts; `base` is the split-conformal base installed with it."""
    from leadtime.predictor.physics import prior_ms
    from leadtime.predictor.target import tree_inputs
    from leadtime.predictor.trees import fit_booster

    tree_x = tree_inputs(x, prior_ms("ttft", x))
    objective = "regression" if kind == "mean" else "quantile"
    tree = fit_booster("ttft", objective, 0.9, tree_x, np.full(len(x), residual), 5, 0)
    mean, upper = (tree, None) if kind == "mean" else (None, tree)
    predictor.install_trees("ttft", mean, upper, 0.0, np.full(10, base))


def _half_learned(seed: int) -> tuple[OnlinePredictor, FeatureBatch, np.ndarray]:
    """A learner without retraining that has learned the first 600 of 1,200 rows of one endpoint."""
    predictor = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    rng = np.random.default_rng(seed)
    rows = [_row(rng, endpoint="ep-0") for _ in range(1200)]
    truth = np.array([_truth(r) for r in rows])
    x = predictor.vectorizer.batch(rows)
    predictor.learn_many(x[:600], truth[:600, 0], truth[:600, 1])
    return predictor, x, truth


@pytest.mark.parametrize(("residual", "retired"), [(0.7, True), (0.0, False)])
def test_a_mean_tree_that_does_worse_than_none_on_later_rows_is_retired(residual: float, retired: bool) -> None:
    """A tree that passed its held-out rows but is wrong on the rows that follow stops serving once it has
    served enough of them to judge; one that does no harm keeps serving."""
    predictor, x, truth = _half_learned(11)
    _installed(predictor, x.X[:600], residual)
    assert predictor._models["ttft"].trees.mean is not None
    before = predictor.predict_many(x[600:]).ttft_mean
    predictor.learn_many(x[600:], truth[600:, 0], truth[600:, 1])
    model = predictor._models["ttft"]
    assert (model.trees.mean is None) is retired
    assert predictor.status()["trees_retired"]["ttft"] == int(retired)
    if retired:
        after = predictor.predict_many(x[600:]).ttft_mean
        error = np.abs(after - truth[600:, 0]) / truth[600:, 0]
        assert error.mean() < 0.5 * (np.abs(before - truth[600:, 0]) / truth[600:, 0]).mean()
    predictor.close()


@pytest.mark.parametrize(("residual", "base", "retired"), [(-1.5, 0.0, True), (0.05, 1.0, False)])
def test_a_quantile_tree_that_does_worse_than_none_on_later_rows_is_retired(
    residual: float, base: float, retired: bool
) -> None:
    """Judged by the pinball loss of the p90 on the rows that follow: a quantile tree that serves a p90 far below
    the outcomes stops serving (the conformal offset takes over and covers again); one closer to them than the
    offset keeps serving."""
    predictor, x, truth = _half_learned(12)
    _installed(predictor, x.X[:600], residual, kind="upper", base=base)
    model = predictor._models["ttft"]
    assert model.trees.upper is not None
    for start in range(600, 1000, 20):  # outcomes arrive a few at a time, as they do from a router
        predictor.learn_many(x[start : start + 20], truth[start : start + 20, 0], truth[start : start + 20, 1])
    assert (model.trees.upper is None) is retired
    assert model.trees.mean is None  # the mean is not judged by the quantile's record
    assert predictor.status()["trees_retired"]["ttft"] == int(retired)
    coverage = float(np.mean(truth[1000:, 0] <= predictor.predict_many(x[1000:]).ttft_quantile))
    assert coverage >= 0.85
    predictor.close()


def test_a_serving_mean_tree_is_recentred_on_the_median_of_its_residuals() -> None:
    """A tree fitted on log residuals predicts their mean; under skewed noise that is above the median, so the
    tree's point is recentred on the median of the residuals it has served, as the online point is on its own:
    about half of the outcomes then fall below the point served."""
    x, ttft = _ramp_rows(3000)
    rng = np.random.default_rng(5)
    order = rng.permutation(len(ttft))  # every load state throughout: the tree stays worth serving
    x, ttft = x[order], ttft[order]
    actual = ttft * np.exp(rng.exponential(0.3, len(ttft)))  # skewed: the median is 0.092 below the mean (log)
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False, retrain=False)
    predictor = OnlinePredictor(config)
    predictor.learn_many(x[:2000], actual[:2000], np.zeros(2000))
    assert predictor.retrain_now()["ttft"]["accepted_mean"]
    model = predictor._models["ttft"]
    assert model.tree_center == 0.0  # a new tree starts without a centre of its own
    served, centres = [], []
    for start in range(2000, 3000, 50):  # outcomes arrive a few at a time, as they do from a router
        served.append(predictor.predict_many(x[start : start + 50]).ttft_mean)
        centres.append(np.full(50, model.tree_center))
        predictor.learn_many(x[start : start + 50], actual[start : start + 50], np.zeros(50))
    assert model.trees.mean is not None
    assert -0.2 < model.tree_center < -0.04
    later, point, centre = actual[2200:], np.concatenate(served)[200:], np.concatenate(centres)[200:]
    assert 0.4 < float(np.mean(later < point)) < 0.6
    assert float(np.mean(later < point / np.exp(centre))) > 0.6  # the tree's point before its recentring
    loaded = OnlinePredictor.from_bytes(predictor.to_bytes(), background=False)  # the centre is kept
    np.testing.assert_allclose(loaded.predict_many(x).ttft_mean, predictor.predict_many(x).ttft_mean, rtol=1e-12)
    loaded.close()
    predictor.close()


def test_never_predicts_what_the_poisoning_guard_would_refuse_to_learn(predictor: OnlinePredictor) -> None:
    """Fed outcomes far below any physics (self-referential ones, in a user's test), the mean TTFT fell to 0.09 ms
    beside an upper quantile of 749 ms: a prediction the service would drop as implausible were it observed. The
    predictions are bounded where the guard is, at 1/IMPLAUSIBLY_FAST of the roofline floor."""
    from leadtime.predictor import physics

    rng = np.random.default_rng(3)
    rows = [_row(rng) for _ in range(2000)]
    x = predictor.vectorizer.batch(rows)
    prior_ttft = physics.prior_ms("ttft", x.X)
    # Outcomes just inside the guard (which drops anything further below): the correction follows them down.
    bound_ttft, bound_tpot = (physics.floor_ms(t, x.X) / physics.IMPLAUSIBLY_FAST for t in ("ttft", "tpot"))
    predictor.learn_many(x, bound_ttft * 1.2, bound_tpot * 1.2)
    assert predictor.status()["implausible"] == 0
    predicted = predictor.predict_many(x)
    ttft_mean, tpot_mean = predicted.ttft_mean, predicted.tpot_mean
    assert ttft_mean.max() < prior_ttft.min() / 10  # the correction did go that far down
    assert not physics.implausible(x.X, ttft_mean, tpot_mean).any()
    assert not physics.implausible(x.X, predicted.ttft_quantile, predicted.tpot_quantile).any()


def test_the_wrong_kind_of_row_is_a_type_error_saying_what_is_taken(predictor: OnlinePredictor) -> None:
    """learn_one(row) was "'FeatureRow' object has no attribute 'row'"; predict_one(None) an AttributeError too."""
    row = FeatureRow(RequestFeatures(10), EndpointState())
    with pytest.raises(TypeError, match="learn_one and learn_many take Observations.*item 0 is FeatureRow"):
        predictor.learn_one(row)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="predict_one and predict_many take FeatureRows.*item 1 is dict"):
        predictor.predict_many([row, {"input_tokens": 10}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="predict_one and predict_many take FeatureRows.*item 0 is dict"):
        predictor.predict_one({"input_tokens": 10})  # type: ignore[arg-type]  # named the other method alone
    # One row to a _many method said "'FeatureRow' object is not iterable"; a row of a string, an AttributeError
    # from inside the vectorizer.
    with pytest.raises(TypeError, match="predict_many takes a sequence of FeatureRows.*got one FeatureRow"):
        predictor.predict_many(row)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="learn_many takes a sequence of Observations.*got one Observation"):
        predictor.learn_many(Observation(row, actual_ttft_ms=5.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FeatureRow.request must be a RequestFeatures, got str"):
        FeatureRow("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FeatureRow.endpoint must be an EndpointState, got dict"):
        FeatureRow(RequestFeatures(10), {"endpoint_id": "a"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Observation.row must be a FeatureRow, got RequestFeatures"):
        Observation(RequestFeatures(10), actual_ttft_ms=5.0)  # type: ignore[arg-type]
    # debug_one said "object of type 'Observation' has no len()", and of a list "'list' object has no attribute 'X'".
    with pytest.raises(TypeError, match="debug_one takes a FeatureRow or a one-row FeatureBatch.*got Observation"):
        predictor.debug_one(Observation(row, actual_ttft_ms=5.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="debug_one takes a FeatureRow or a one-row FeatureBatch.*got list"):
        predictor.debug_one([row])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be an integer, got 1000.5"):
        LearnerConfig(window=1000.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantile must be a number, got '0.9'"):
        LearnerConfig(quantile="0.9")  # type: ignore[arg-type]


def test_a_min_window_larger_than_the_window_is_refused_naming_both() -> None:
    """Regression: `window=100, min_window=300` was accepted, and no tree was ever fitted (the window never held
    the rows a first tree needs), without a word."""
    with pytest.raises(ValueError, match=r"min_window \(300\) must be ≤ window \(200\)"):
        LearnerConfig(window=200, min_window=300)
    assert LearnerConfig(window=300, min_window=300).min_window == 300


def test_an_absurd_outcome_is_not_learned(predictor: OnlinePredictor) -> None:
    """One TTFT of 1e300 ms made the next prediction 1.9e25 ms for 50 to 200 rows: the learner drops what the
    service's poisoning guard drops (physics.implausible), and counts it."""
    rng = np.random.default_rng(5)
    rows = [_row(rng) for _ in range(60)]
    for r in rows[:50]:
        predictor.learn_one(Observation(r, *_truth(r)))
    before = predictor.predict_one(rows[55])["ttft_mean"]
    predictor.learn_one(Observation(rows[50], 1e300, 10.0))
    after = predictor.predict_one(rows[55])["ttft_mean"]
    assert after == pytest.approx(before) and predictor.status()["implausible"] == 1


def test_an_offset_table_keeps_the_keys_learned_most_recently_up_to_its_bound() -> None:
    """Observations naming ever new endpoint ids grew the model without bound (50,000 ids: a 91 MB artifact and
    prediction p99 of 50 ms while it was re-encoded at every snapshot)."""
    from leadtime.predictor.online import MAX_OFFSET_KEYS, OffsetTable

    table = OffsetTable(max_keys=3)
    for key in ("a", "b", "c", "a", "d"):  # "a" learned again: "b" is now the least recent
        table.learn_one(key, 0.5)
    assert len(table) == 3
    assert table.get("b") == 0.0 and table.get("a") != 0.0 and table.get("d") != 0.0
    restored = OffsetTable.from_dict(table.to_dict())
    restored.learn_one("e", 0.5)  # the order survives a save: "c" goes next
    assert restored.get("c") == 0.0 and len(restored) == 3
    flooded = OffsetTable()
    for i in range(MAX_OFFSET_KEYS + 500):
        flooded.learn_one(f"endpoint-{i}", 0.1)
    assert len(flooded) == MAX_OFFSET_KEYS


def test_the_drift_detector_detects_where_rivers_adwin_does() -> None:
    """The detector is river's ADWIN core reached without `from river import drift` (which imports scikit-learn,
    scipy and pandas at every start): it must detect on the same updates, resets included."""
    from river import drift

    rng = np.random.default_rng(0)
    stream = np.concatenate([rng.normal(level, 0.3, 3000) for level in (0.0, 1.5, 0.2, 3.0)])
    ours, river_adwin = new_drift_detector(), drift.ADWIN()
    detected: tuple[list[int], list[int]] = ([], [])
    for i, x in enumerate(stream):
        ours.update(float(x))
        river_adwin.update(float(x))
        for found, detector in zip(detected, (ours, river_adwin), strict=True):
            if detector.drift_detected:
                found.append(i)
    assert len(detected[1]) >= 3 and detected[0] == detected[1], detected


def test_a_process_that_predicts_imports_neither_lightgbm_nor_scikit_learn() -> None:
    """The service, the gateway and the simulator predict with compiled trees: LightGBM (and through it and
    river's drift package, scikit-learn, scipy.stats and pandas) cost ~1 s and ~150 MiB at every start when
    imported up front; a retrain imports LightGBM when it fits. A river older than 0.25 has no ADWIN core of its
    own (`new_drift_detector` falls back on `river.drift`, which imports the other three): LightGBM stays out."""
    code = (
        "import sys\n"
        "import leadtime.predictor.service.app, leadtime.router_plugin.gateway.app, leadtime.simulator.run\n"
        "from leadtime.predictor.learner import OnlinePredictor\n"
        "OnlinePredictor()\n"
        "print(sorted(m for m in ('lightgbm', 'sklearn', 'scipy.stats', 'pandas') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    imported = ast.literal_eval(out.stdout.strip())
    assert "lightgbm" not in imported, out.stdout + out.stderr
    if isinstance(new_drift_detector(), _Adwin):  # river's own ADWIN core, not river.drift
        assert imported == [], out.stdout + out.stderr


def test_a_learner_started_without_importing_now_leaves_lightgbm_to_its_first_retrain() -> None:
    """The service's learner process starts with `import_now=False`: it serves nothing, and most of its starts
    never retrain (each test's app, a restart, a replica without the lease), yet each paid 1.4 s of CPU importing
    LightGBM, scikit-learn and pandas (a third of the test suite's CPU). A retrain imports it when it fits; a
    predictor that retrains beside live traffic (`route --embedded`) still takes it at start."""
    code = (
        "import sys\n"
        "from leadtime.predictor.learner import LearnerConfig, OnlinePredictor\n"
        "OnlinePredictor(LearnerConfig(background=True)).start(import_now=False).close()\n"
        "print('lightgbm' in sys.modules)\n"
        "OnlinePredictor(LearnerConfig(background=True)).start().close()\n"
        "print('lightgbm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


def test_a_retrain_judges_a_mean_tree_against_the_recentred_model_that_serves() -> None:
    """Regression: the swap test judged a candidate mean tree against no correction at all, while the model it
    replaces serves the online parts recentred on their median residual: a tree that learned only that constant
    offset (biased by a tail of slow rows) was accepted though it served worse than the model it replaced."""
    from leadtime.features.vectorize import Vectorizer
    from leadtime.predictor.physics import prior_ms
    from leadtime.predictor.target import TargetModel

    rng = np.random.default_rng(0)
    vectorizer = Vectorizer()

    def batch(n: int) -> FeatureBatch:
        requests = rng.integers(10, 4000, n).tolist()
        running = rng.integers(0, 32, n).tolist()
        return vectorizer.batch(
            [
                FeatureRow(RequestFeatures(i), EndpointState(num_request_running=r))
                for i, r in zip(requests, running, strict=True)
            ]
        )

    def residuals(n: int) -> np.ndarray:  # no structure: a constant offset, noise, and 5% of rows 20x slow
        return 0.5 + 0.05 * rng.standard_normal(n) + np.where(rng.random(n) < 0.05, 3.0, 0.0)

    model = TargetModel("tpot", 0.9, 20_000, 0.998)
    b = batch(2000)
    online = model.online_log(b.X, prior_ms("tpot", b.X), b.classes, None)
    for r in residuals(1000):
        model.conformal.observe(float(r), True)
    z = online + residuals(len(online))
    _, outcome = model.fit_candidate((b.X, z, b.classes, [""] * len(z)), 0.9, 60, 0, 300)
    assert not outcome["accepted_mean"], outcome
    assert outcome["heldout_ape_before"] < 0.15  # what serves: the recentred online parts, not 0.4 off


def test_learning_in_blocks_keeps_the_error_scale_a_row_at_a_time_would() -> None:
    """Regression: a block's errors were averaged into the running error scale each with the divisor of the block's
    last row, so batched ingestion (blocks of 32) held the scale at 0.64 of the errors after 32 rows and clipped
    innovations at 2.6 rather than 4 times it over the first few hundred rows."""
    from leadtime.predictor.online import RecursiveLeastSquares

    rng = np.random.default_rng(0)
    phi = np.column_stack([np.ones(384), rng.uniform(0.0, 1.0, 384)])
    y = phi @ np.array([2.0, 3.0]) + np.where(rng.random(384) < 0.5, 1.0, -1.0)  # every error about 1
    one, many = (
        RecursiveLeastSquares(2, forgetting=1.0, clip=np.inf),
        RecursiveLeastSquares(2, forgetting=1.0, clip=np.inf),
    )
    for i in range(384):
        one.learn_one(phi[i], float(y[i]))
    for start in range(0, 384, 32):
        many.learn_many(phi[start : start + 32], y[start : start + 32])
    np.testing.assert_allclose(many.weights, one.weights, rtol=1e-9)
    first_block = RecursiveLeastSquares(2, forgetting=1.0, clip=np.inf)
    errors = first_block.learn_many(phi[:32], y[:32])
    assert first_block._mean_abs_error == pytest.approx(float(np.mean(np.abs(errors))))


def test_close_called_by_a_retrain_listener_stops_retraining_and_start_begins_it_again() -> None:
    """A listener runs on the retrain thread: `close()` there raised "cannot join current thread" (recorded as a
    failed retrain, though the retrain had run) and left the ended thread recorded, so that `start()` afterwards
    started none, and the predictor never retrained again."""
    import threading

    rng = np.random.default_rng(5)
    p = OnlinePredictor(LearnerConfig(retrain_every=50, min_window=1000))  # retrains that fit nothing: quick
    retrained = [threading.Event(), threading.Event()]
    calls: list[dict] = []

    def listener(result: dict) -> None:
        calls.append(result)
        if len(calls) == 1:
            p.close()
        retrained[min(len(calls), 2) - 1].set()

    p.add_retrain_listener(listener)
    observations = [Observation(r, *_truth(r)) for r in (_row(rng) for _ in range(60))]
    p.start().learn_many(observations)
    assert retrained[0].wait(timeout=60)
    assert p.status()["retrain_error"] is None and p.retrain_failures == 0
    p.start().learn_many(observations)
    try:
        assert retrained[1].wait(timeout=60), "started again, the predictor should retrain again"
    finally:
        p.close()
