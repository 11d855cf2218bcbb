"""The TTFT ceiling: a wall of outcomes (clients giving up) detected and applied as a cap, and nothing else."""

from __future__ import annotations

import json

import numpy as np
import pytest

from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
from leadtime.predictor.ceiling import OutcomeCeiling
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor


def _wall(n: int = 300, level: float = 60_000.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Outcomes at a timeout while the predictions keep growing with the queue."""
    rng = np.random.default_rng(seed)
    return level + rng.normal(0, 0.005 * level, n), np.linspace(0.7 * level, 2.0 * level, n)


def test_a_wall_caps_the_mean_at_its_median_and_the_quantile_at_its_spread() -> None:
    ceiling = OutcomeCeiling()
    actual, predicted = _wall()
    ceiling.learn_many(actual, predicted)
    assert ceiling.active
    assert abs(ceiling.level_ms - 60_000) < 300
    # The mean is capped at the median of the outcomes at the wall, not at the level that found it (the median
    # of the window's upper half: the pile's 75th percentile once every outcome is at the wall).
    assert ceiling.slope == 0.0  # no row had a prefill of its own
    assert ceiling.base_ms == np.median(actual[-ceiling.window :])
    assert ceiling.base_ms < ceiling.level_ms
    assert ceiling.base_ms <= ceiling.upper_cap_ms(0.0) < 61_000
    mean, upper = ceiling.cap(
        np.array([10_000.0, 50_000.0, 200_000.0, 59_000.0]), np.array([15_000.0, 48_000.0, 300_000.0, 58_000.0])
    )
    assert mean[0] == 10_000 and mean[1] == 50_000 and mean[3] == 59_000  # below the wall: untouched
    assert mean[2] == ceiling.base_ms
    assert upper[0] == 15_000
    assert upper[1] == 50_000  # never below the mean
    assert upper[2] == ceiling.upper_cap_ms(0.0)
    assert upper[3] == ceiling.upper_cap_ms(0.0)  # reaches the pile: the pile's upper quantile


def test_an_upper_quantile_that_reaches_the_pile_is_the_piles_own() -> None:
    """A row predicted just short of the wall is one the queue may hold until the timeout: its upper quantile,
    once within the band below the wall, is raised to the pile's (and covers the outcomes at the wall); one
    that stays below the band is the model's own."""
    ceiling = OutcomeCeiling()
    actual, predicted = _wall()
    ceiling.learn_many(actual, predicted)
    wall, pile_upper = ceiling.mean_cap_ms(0.0), ceiling.upper_cap_ms(0.0)
    means = np.array([0.90, 0.93, 0.94]) * wall
    uppers = np.array([0.94, 0.96, 0.99]) * wall
    _, upper = ceiling.cap(means, uppers)
    assert upper[0] == uppers[0]  # 6% short of the wall: outside the 5% band
    assert upper[1] == pile_upper and upper[2] == pile_upper
    at_wall = actual[-ceiling.window :]
    assert np.mean(at_wall <= upper[1]) > np.mean(at_wall <= uppers[1])
    # Single values are served the same way (the learner judges each row's coverage with them).
    assert ceiling.cap(float(means[1]), float(uppers[1]))[1] == pile_upper


def test_a_pile_whose_predictions_above_it_come_true_is_not_a_wall() -> None:
    # A steady load with one prompt length: most outcomes alike, and the rows predicted higher were higher.
    rng = np.random.default_rng(1)
    predicted = np.where(rng.random(300) < 0.7, 5_000.0, rng.uniform(6_000, 20_000, 300))
    ceiling = OutcomeCeiling()
    ceiling.learn_many(predicted * rng.normal(1.0, 0.01, 300), predicted)
    assert not ceiling.active
    mean = np.array([20_000.0])
    assert ceiling.cap(mean, mean)[0] is mean


def test_a_slow_climb_that_the_predictions_follow_is_not_a_wall() -> None:
    """A queue that keeps growing, seen over a window in which its TTFT (over 8 minutes by now) rises 2%:
    the outcomes pile up within the band, and the predictions that land above the pile by their noise come out
    in it. A wall is a pile the predictions overshoot by more than its width."""
    rng = np.random.default_rng(8)
    actual = np.linspace(500_000, 510_000, 256)
    ceiling = OutcomeCeiling()
    ceiling.learn_many(actual, actual * np.exp(rng.normal(0, 0.04, 256)))
    assert not ceiling.active


def test_a_pile_without_any_prediction_above_it_is_not_taken_for_a_wall() -> None:
    actual, _ = _wall()
    ceiling = OutcomeCeiling()
    ceiling.learn_many(actual, np.full(len(actual), 50_000.0))
    assert not ceiling.active


def test_spread_outcomes_and_sub_second_piles_are_not_walls() -> None:
    rng = np.random.default_rng(2)
    spread = OutcomeCeiling()
    queue = rng.exponential(20_000, 300)
    spread.learn_many(queue, 3 * queue)  # even over-predicted 3x: no pile
    assert not spread.active
    fast = OutcomeCeiling()
    actual, predicted = _wall(level=400.0)
    fast.learn_many(actual, predicted)  # a pile at 0.4 s is a fast server, not a client's timeout
    assert not fast.active


def test_the_cap_goes_when_the_outcomes_leave_the_wall() -> None:
    ceiling = OutcomeCeiling(window=128)
    actual, predicted = _wall()
    ceiling.learn_many(actual, predicted)
    assert ceiling.active
    rng = np.random.default_rng(3)
    light = rng.uniform(200, 3_000, 128)
    ceiling.learn_many(light, light * 1.05)
    assert not ceiling.active


def test_the_state_round_trips() -> None:
    ceiling = OutcomeCeiling()
    ceiling.learn_many(*_wall())
    again = OutcomeCeiling()
    again.load_dict(ceiling.to_dict())
    assert again.active and again.level_ms == ceiling.level_ms and again.upper_cap_ms(0.0) == ceiling.upper_cap_ms(0.0)


def _queued(waiting: int) -> FeatureRow:
    return FeatureRow(
        RequestFeatures(input_tokens=4000),
        EndpointState(num_request_waiting=waiting, prefill_tokens_in_flight=4000 * waiting, kv_cache_percentage=0.95),
    )


def test_a_learner_whose_clients_give_up_predicts_the_timeout_not_the_drain_time() -> None:
    """Every recorded TTFT is ~60 s however deep the queue: predictions stop at the wall, TPOT is untouched,
    and a saved model keeps the cap."""
    rng = np.random.default_rng(4)
    p = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    observations = []
    for _ in range(600):
        row = _queued(int(rng.integers(100, 500)))
        observations.append(Observation(row, actual_ttft_ms=60_000 + rng.normal(0, 300), actual_tpot_ms=40.0))
    p.learn_many(observations)
    deep = p.predict_one(_queued(2000))
    assert abs(deep["ttft_mean"] - 60_000) < 0.02 * 60_000
    assert 60_000 <= deep["ttft_quantile"] < 62_000
    assert p._models["tpot"].ceiling is None
    ttft_part, tpot_part = p.debug_one(_queued(2000)).split("tpot:")
    assert "client-timeout wall" not in tpot_part
    (wall_line,) = [line for line in ttft_part.splitlines() if "client-timeout wall" in line]
    (pile_line,) = [line for line in ttft_part.splitlines() if "at the pile" in line]
    # The deep queue's mean is the wall itself and its p90 the pile's: the explanation names both.
    assert float(wall_line.split()[2]) == round(deep["ttft_mean"], 2)
    assert float(pile_line.split()[4]) == round(deep["ttft_quantile"], 2)
    loaded = OnlinePredictor.from_bytes(p.to_bytes())
    assert loaded.predict_one(_queued(2000))["ttft_mean"] == deep["ttft_mean"]


def test_the_wall_is_tested_as_outcomes_arrive_not_at_the_calibrations_settle() -> None:
    """Requests learned one at a time: the wall holds within 16 outcomes of the evidence, not at the next settle
    of the calibration (every 64 outcomes), which under delayed labels cost up to 64 more rows predicted at the
    drain time."""
    rng = np.random.default_rng(6)
    p = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    ceiling = p._models["ttft"].ceiling
    assert ceiling is not None
    learned = 0
    while not ceiling.active:
        row = _queued(int(rng.integers(100, 500)))
        p.learn_one(Observation(row, actual_ttft_ms=60_000 + rng.normal(0, 300), actual_tpot_ms=40.0))
        learned += 1
        assert learned < 200
    assert learned % ceiling.every == 0
    assert learned % 64 != 0
    assert abs(p.predict_one(_queued(2000))["ttft_mean"] - 60_000) < 0.02 * 60_000


@pytest.mark.parametrize("key", ["ceiling", "wait_bound"])
def test_an_artifact_from_before_the_ceiling_or_the_wait_bound_still_loads(key: str) -> None:
    p = OnlinePredictor(LearnerConfig(background=False))
    p.learn_one(Observation(_queued(3), actual_ttft_ms=900.0, actual_tpot_ms=30.0))
    state, _ = p.snapshot()
    del state["targets"]["ttft"][key]
    loaded = OnlinePredictor.from_state(state)
    assert loaded.predict_one(_queued(3)) == p.predict_one(_queued(3))


def test_the_capped_quantile_keeps_its_coverage_while_the_wall_drifts() -> None:
    """A wall rising by 20% over 800 rows (prompts getting longer): the window's p90 lags it; the adaptive term
    answers for the rows capped."""

    def coverage(step: float) -> float:
        ceiling, rng = OutcomeCeiling(step=step), np.random.default_rng(5)
        ceiling.learn_many(*_wall())
        covered = []
        for k in range(100):
            actual = 60_000 * (1 + 0.2 * k / 100) + rng.normal(0, 300, 8)
            covered += list(actual <= ceiling.upper_cap_ms(0.0))  # what was served before these outcomes were learned
            ceiling.learn_many(actual, np.full(8, 150_000.0))
        assert ceiling.active
        return float(np.mean(covered))

    assert coverage(step=0.0) < 0.5
    assert 0.85 <= coverage(step=0.01) <= 0.95


def test_outcomes_at_the_wall_are_lower_bounds_so_rows_below_it_are_not_pulled_down() -> None:
    """Queues from shallow to deep, each request taking three times the prior's drain time unless a 60 s client
    timeout cuts it. The outcomes at the wall say only that those requests would have waited at least that long:
    learned as measures they dragged the correction down, and rows below the wall were predicted short of their
    own outcomes (25% short at 50 s). Learned as the lower bounds they are, the rows below are predicted as they
    come out and those above stop at the wall. Rows arrive a few at a time, as they complete."""
    cold = OnlinePredictor(LearnerConfig(background=False))
    depths = list(range(10, 700, 10))
    drain = {w: 3 * cold.predict_one(_queued(w))["ttft_mean"] for w in depths}
    rng = np.random.default_rng(7)
    p = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    for _ in range(94):
        batch = []
        for w in rng.choice(depths, 16).tolist():
            actual = min(drain[w], 60_000.0) * float(np.exp(rng.normal(0, 0.02)))
            batch.append(Observation(_queued(w), actual_ttft_ms=actual, actual_tpot_ms=40.0))
        p.learn_many(batch)
    assert p._models["ttft"].ceiling is not None and p._models["ttft"].ceiling.active
    for w in (60, 150, 200, 400):
        truth = min(drain[w], 60_000.0)
        assert abs(p.predict_one(_queued(w))["ttft_mean"] - truth) < 0.03 * truth, w


def test_a_queue_the_model_overshoots_is_not_a_wall_while_its_outcomes_follow_the_predictions() -> None:
    """The end of a queue that keeps growing: outcomes within a few percent of each other (a pile), every
    prediction above it by a third (overshoot), but each outcome still rises with its prediction. A wall's
    outcomes do not: they are the timeout whatever was predicted."""
    rng = np.random.default_rng(3)
    actual = np.linspace(2_400_000, 2_600_000, 128) * np.exp(rng.normal(0, 0.01, 128))
    overshooting = OutcomeCeiling()
    overshooting.learn_many(actual, 1.35 * actual * np.exp(rng.normal(0, 0.02, 128)))
    assert not overshooting.active
    wall = OutcomeCeiling()
    wall.learn_many(actual, 1.35 * rng.permutation(actual) * np.exp(rng.normal(0, 0.02, 128)))
    assert wall.active


def test_each_row_is_capped_at_the_timeout_plus_its_own_prefill() -> None:
    """A request served at a client's timeout waited about the timeout and then had its own prompt prefilled: a
    long document comes out seconds above a short chat. One level for all of them over-predicts the chats and
    under-predicts the documents; the wall is fitted as base + slope × own prefill."""
    rng = np.random.default_rng(7)
    own = np.where(rng.random(300) < 0.5, rng.uniform(10, 50, 300), rng.uniform(500, 1_000, 300))
    actual = 60_000 + 2.2 * own + rng.normal(0, 100, 300)
    ceiling = OutcomeCeiling()
    ceiling.learn_many(actual, np.linspace(50_000, 150_000, 300), own)
    assert ceiling.active
    assert abs(ceiling.slope - 2.2) < 0.1
    chat, document = np.array([30.0]), np.array([900.0])
    far_above = np.array([500_000.0])
    assert abs(ceiling.cap(far_above, far_above, chat)[0][0] - (60_000 + 2.2 * 30)) < 100
    assert abs(ceiling.cap(far_above, far_above, document)[0][0] - (60_000 + 2.2 * 900)) < 100
    recent = actual[-ceiling.window :]
    one_level = np.median(recent)
    per_row = ceiling.cap(np.full(300, 500_000.0), np.full(300, 500_000.0), own)[0][-ceiling.window :]
    assert np.mean(np.abs(per_row / recent - 1)) < 0.5 * np.mean(np.abs(one_level / recent - 1))


def test_a_wall_saved_before_it_knew_each_rows_prefill_still_loads() -> None:
    ceiling = OutcomeCeiling()
    ceiling.learn_many(*_wall())
    old = {"recent": [[a, p] for a, p, _ in ceiling.to_dict()["recent"]], "adaptive": 0.0}
    again = OutcomeCeiling()
    again.load_dict(old)
    assert again.active and again.base_ms == ceiling.base_ms


def _wall_with_untested_outcomes() -> OutcomeCeiling:
    """An active wall that has learned 10 outcomes since its last test (fewer than `every`), outcomes that leave
    it: testing them too moves the wall."""
    rng = np.random.default_rng(0)
    ceiling = OutcomeCeiling()
    own = rng.uniform(0, 1000, 320)
    ceiling.learn_many(60_000 + 2 * own + rng.normal(0, 300, 320), np.linspace(40_000, 120_000, 320), own)
    ceiling.learn_many(np.full(10, 61_500.0), np.full(10, 130_000.0), rng.uniform(0, 1000, 10))
    assert ceiling.active and ceiling._unseen == 10
    return ceiling


def _served(ceiling: OutcomeCeiling) -> tuple[np.ndarray, np.ndarray]:
    """What the wall serves for rows far above it, just below it and far below it, each with and without a
    prefill of its own."""
    mean = np.array([90_000.0, 90_000.0, 58_000.0, 58_000.0, 20_000.0, 20_000.0])
    upper = np.array([130_000.0, 130_000.0, 59_000.0, 59_000.0, 30_000.0, 30_000.0])
    own = np.array([0.0, 800.0, 0.0, 800.0, 0.0, 800.0])
    return ceiling.cap(mean, upper, own)


def test_a_saved_wall_loads_as_it_was_served_and_learns_on_as_if_never_saved() -> None:
    """Regression: a saved wall was found again from its recent outcomes on load, including those the live wall
    had not tested yet: the loaded wall stood elsewhere (base 60003.9 ms → 60115.2 ms here), so a service that
    took the learner's snapshot, or a restart from the saved model, served another cap than the learner computed
    (and could even switch the wall on or off)."""
    ceiling = _wall_with_untested_outcomes()
    again = OutcomeCeiling()
    again.load_dict(json.loads(json.dumps(ceiling.to_dict())))
    for name in ("active", "level_ms", "base_ms", "slope", "base_upper_ms", "adaptive", "_unseen"):
        assert getattr(again, name) == getattr(ceiling, name), name
    for loaded, live in zip(_served(again), _served(ceiling), strict=True):
        np.testing.assert_array_equal(loaded, live)
    # Learning on: the outcomes untested at the save are tested with the next ones, as they would have been.
    rng = np.random.default_rng(1)
    for _ in range(20):  # 140 outcomes off the wall: more than the window
        actual, predicted, own = rng.uniform(1_000, 3_000, 7), rng.uniform(1_000, 3_000, 7), rng.uniform(0, 500, 7)
        ceiling.learn_many(actual, predicted, own)
        again.learn_many(actual, predicted, own)
        for loaded, live in zip(_served(again), _served(ceiling), strict=True):
            np.testing.assert_array_equal(loaded, live)
    assert not ceiling.active and not again.active  # the wall went, at the same outcome for both


def test_a_wall_saved_before_its_fitted_state_was_kept_is_found_again_from_its_outcomes() -> None:
    """Artifacts written before the wall's fitted state was saved hold only the outcomes and the adaptive term:
    the wall is found again from them, as those builds did."""
    ceiling = OutcomeCeiling()
    ceiling.learn_many(*_wall())
    old = {key: ceiling.to_dict()[key] for key in ("recent", "adaptive")}
    again = OutcomeCeiling()
    again.load_dict(old)
    assert again.active and again.base_ms == ceiling.base_ms and again._unseen == 0


def _learn_at_a_wall(p: OnlinePredictor, rng: np.random.Generator, n: int) -> None:
    """Rows of queues ever deeper whose clients give up at 60 s, learned one at a time."""
    for _ in range(n):
        row = _queued(int(rng.integers(100, 500)))
        p.learn_one(Observation(row, actual_ttft_ms=60_000 + rng.normal(0, 300), actual_tpot_ms=40.0))


def test_a_predictor_with_a_wall_predicts_the_same_after_a_round_trip_and_after_learning_on() -> None:
    """Regression: a predictor saved with outcomes its wall had not tested yet predicted another TTFT once
    loaded (means 60239.83 ms → 60221.33 ms in a user's probe), by bytes (a restart) as by snapshot (the learner
    process handing its model to the service)."""
    rng = np.random.default_rng(4)
    p = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    _learn_at_a_wall(p, rng, 600)
    wall = p._models["ttft"].ceiling
    assert wall is not None and wall.active
    p.learn_many([Observation(_queued(450), actual_ttft_ms=66_000.0, actual_tpot_ms=40.0)] * 7)
    assert wall._unseen != 0
    rows = [_queued(w) for w in (50, 300, 500, 2000)]

    def served(q: OnlinePredictor) -> np.ndarray:
        pred = q.predict_many(rows)
        return np.concatenate([pred.ttft_mean, pred.ttft_quantile, pred.tpot_mean, pred.tpot_quantile])

    by_bytes = OnlinePredictor.from_bytes(p.to_bytes(), background=False)
    state, compiled = p.snapshot()
    by_snapshot = OnlinePredictor.from_state(state, background=False, compiled=compiled)
    np.testing.assert_array_equal(served(by_bytes), served(p))
    np.testing.assert_array_equal(served(by_snapshot), served(p))
    for q in (p, by_bytes):
        _learn_at_a_wall(q, np.random.default_rng(5), 40)  # the same 40 outcomes
    np.testing.assert_array_equal(served(by_bytes), served(p))


def test_a_prediction_made_while_a_standing_wall_is_tested_again_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall is tested again every 16 outcomes, and the test began by switching it off: a prediction made on
    another thread meanwhile (a router predicting while it learns) was served uncapped, at the model's 200 s
    instead of the wall's 60 s. The prediction is made here from inside the test (`_slope`, which it calls after
    finding the pile), where another thread's would land."""
    from leadtime.predictor import ceiling as module

    ceiling = OutcomeCeiling()
    actual, predicted = _wall()
    ceiling.learn_many(actual, predicted)
    assert ceiling.active
    served: list[float] = []
    slope = module._slope

    def predicting_meanwhile(x: np.ndarray, y: np.ndarray) -> float:
        served.append(float(ceiling.cap(np.array([200_000.0]), np.array([300_000.0]))[0][0]))
        return slope(x, y)

    monkeypatch.setattr(module, "_slope", predicting_meanwhile)
    ceiling.learn_many(actual[-16:], predicted[-16:])  # the same wall, tested again
    assert ceiling.active and served
    assert max(served) < 61_000
