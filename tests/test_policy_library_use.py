"""The router plugin used as a library, as a user writing their own router would: what it takes, what it says when
given something else, a predictor that refuses what it is told, and several threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest

from leadtime.features.rows import EndpointState, FeatureRow, Observation
from leadtime.predictor.client import BulkPredictions, PredictorError
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.router_plugin.client import InProcessPredictor
from leadtime.router_plugin.config import SHIPPED_CONFIG, build_policy
from leadtime.router_plugin.policy import Candidate, Outcome, RouteRequest
from leadtime.router_plugin.predicted import LeadtimePolicy


def states(n: int = 3) -> list[Candidate]:
    return [Candidate(EndpointState(endpoint_id=f"e{i}", num_request_running=i)) for i in range(n)]


def learner() -> InProcessPredictor:
    return InProcessPredictor(OnlinePredictor(LearnerConfig(background=False)))


def test_a_predictor_that_is_not_a_predictor_client_is_refused_when_the_policy_is_made() -> None:
    """An OnlinePredictor given as is failed at the first pick: `'OnlinePredictor' object has no attribute
    'predict'`."""
    with pytest.raises(TypeError, match=r"PredictorClient, got OnlinePredictor .*InProcessPredictor"):
        LeadtimePolicy(OnlinePredictor(LearnerConfig(background=False)))  # type: ignore[arg-type]


def test_candidates_that_are_not_candidates_are_refused_by_name() -> None:
    """An EndpointState list failed deep inside: `'EndpointState' object has no attribute 'timeslice_group'`."""
    policy = LeadtimePolicy(learner())
    given = [c.state for c in states()]
    with pytest.raises(TypeError, match=r"candidates\[0\] must be a Candidate, got EndpointState"):
        policy.pick(RouteRequest("r", 100), given)  # type: ignore[arg-type]


def test_build_policy_takes_the_path_of_a_yaml_file_as_text_too() -> None:
    """Only a pathlib.Path was taken; a str read as the configuration's document ('Input should be a valid
    dictionary')."""
    policy = build_policy(str(SHIPPED_CONFIG), learner())
    assert policy.pick(RouteRequest("r", 100), states()).endpoint_id in {"e0", "e1", "e2"}


class Refusing(InProcessPredictor):
    """A predictor that answers predictions and refuses every observation (a service wanting a token)."""

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        raise PredictorError(401, "the write paths need 'Authorization: Bearer <api token>'")


def test_a_predictor_refusing_observations_is_said_once_not_swallowed(caplog: pytest.LogCaptureFixture) -> None:
    """Twenty requests learned nothing, silently: the router routed on the untrained prior for ever."""
    policy = LeadtimePolicy(Refusing(OnlinePredictor(LearnerConfig(background=False))))
    with caplog.at_level(logging.WARNING, logger="leadtime"):
        for i in range(20):
            pick = policy.pick(RouteRequest(f"r{i}", 100), states())
            policy.observe(Outcome(f"r{i}", pick.endpoint_id, None, 50.0, 10.0, 5, 1000.0 + i))
    assert policy.counters.unreported == 20 and policy.counters.learned == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "refuses observations" in warnings[0] and "401" in warnings[0]


class Counting(InProcessPredictor):
    """Counts what it learned, to compare with the policy's own count."""

    def __init__(self) -> None:
        super().__init__(OnlinePredictor(LearnerConfig(background=False)))
        self.taken = 0
        self._lock = threading.Lock()

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        return super().predict(rows, deadline_s)

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        learned = super().observe(observations, deadline_s)
        with self._lock:
            self.taken += learned
        return learned


def test_a_policy_shared_by_threads_counts_what_it_learned() -> None:
    """Four threads picking and reporting on one policy: 2,585 of 6,000 observations counted as learned."""
    predictor = Counting()
    policy = LeadtimePolicy(predictor)

    def route(thread: int) -> None:
        for i in range(300):
            request_id = f"t{thread}-{i}"
            pick = policy.pick(RouteRequest(request_id, 100 + i), states())
            policy.observe(Outcome(request_id, pick.endpoint_id, None, 50.0, 10.0, 5, 1000.0 + i))

    threads = [threading.Thread(target=route, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert policy.counters.decisions == 1200
    assert predictor.taken == 1200 and policy.counters.learned == predictor.taken
