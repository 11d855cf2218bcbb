"""The router plugin used as a library, as a user writing their own router would: what it takes, what it says when
given something else, a predictor that refuses what it is told, and several threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
from leadtime.predictor.client import BulkPredictions, HttpPredictorClient, PredictorError
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.router_plugin.client import InProcessPredictor
from leadtime.router_plugin.config import SHIPPED_CONFIG, build_policy
from leadtime.router_plugin.policy import Candidate, Outcome, RouteRequest
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy


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


def test_a_row_the_predictor_refuses_falls_back_in_process_as_over_http() -> None:
    """An unknown accelerator class raised FeatureError out of `pick` in process, while over HTTP (422) and gRPC
    the same row fell back to the heuristics: the clients are meant to be interchangeable."""
    policy = LeadtimePolicy(learner())
    pick = policy.pick(RouteRequest("r", 10), [Candidate(EndpointState("x", "rtx4090"))])
    assert pick.endpoint_id == "x" and policy.counters.fallbacks == 1
    with pytest.raises(PredictorError, match="rtx4090"):
        learner().predict([FeatureRow(RequestFeatures(10), EndpointState("x", "rtx4090"))])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"fit": "bogus"}, "fit"),
        ({"overflow": "bogus"}, "overflow"),
        ({"exploration": 5.0}, "exploration"),
        ({"comfort": -0.1}, "comfort"),
        ({"overflow_endpoints": "ab"}, "overflow_endpoints"),
        ({"kv_link_gb_s": 0.0}, "kv_link_gb_s"),
        ({"local_prefill_itl_share": 0.0}, "local_prefill_itl_share"),  # as the YAML (> 0)
    ],
)
def test_a_leadtime_config_out_of_range_is_refused_by_name(options: dict[str, object], named: str) -> None:
    """The YAML refused `exploration: 2`; the dataclass took it (every decision explored), and an unknown `fit`
    or `overflow` silently behaved as the default."""
    with pytest.raises(ValueError, match=f"^{named}: "):
        LeadtimeConfig(**options)  # type: ignore[arg-type]


def test_an_outcome_for_a_request_never_picked_changes_nothing() -> None:
    """It moved the policy's mean output length (from 256 to 1,253 on one outcome of 100,000 tokens), which
    weighs decode harm, and the endpoint it named was taken as heard from."""
    policy = LeadtimePolicy(learner())
    before = policy.pick(RouteRequest("a", 100), states())
    policy.observe(Outcome("a", before.endpoint_id, None, 50.0, 10.0, 20, 1_000.0))
    state = (policy._output_tokens, dict(policy._last_heard))
    policy.observe(Outcome("never-picked", "ghost", None, 10.0, 5.0, 100_000, 1e9))
    assert (policy._output_tokens, dict(policy._last_heard)) == state


def test_a_seed_the_yaml_gives_is_kept_even_zero(tmp_path: Path) -> None:
    """`seed: 0` in the YAML was taken as unset and replaced by the caller's seed (`latency.seed or seed`)."""
    text = SHIPPED_CONFIG.read_text()
    assert "seed:" not in text
    config = tmp_path / "c.yaml"
    config.write_text(text.replace("exploration:", "seed: 0\n      exploration:", 1))
    assert "seed: 0" in config.read_text()
    policy = build_policy(config, learner(), seed=7)
    assert isinstance(policy, LeadtimePolicy) and policy.config.seed == 0
    assert build_policy(SHIPPED_CONFIG, learner(), seed=7).config.seed == 7  # type: ignore[attr-defined]


def test_an_http_client_given_an_address_without_a_scheme_is_refused_when_made() -> None:
    """`HttpPredictorClient("127.0.0.1:8000")` was taken, and every call then failed as the predictor being away
    (PredictorUnavailable): a router so configured fell back for ever."""
    with pytest.raises(ValueError, match=r"'127.0.0.1:8000'.*http://HOST:PORT or https://"):
        HttpPredictorClient("127.0.0.1:8000")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"prefix_hit_tokens": "x"}, "prefix_hit_tokens"),
        ({"prefix_hit_tokens": float("nan")}, "prefix_hit_tokens"),
        ({"published_ms": float("nan")}, "published_ms"),
        ({"kv_cache_tokens": -1}, "kv_cache_tokens"),
    ],
)
def test_a_candidate_with_a_bad_value_is_refused_when_made_naming_it(options: dict[str, object], named: str) -> None:
    """`prefix_hit_tokens="x"` failed inside `pick` ("'<' not supported"), a NaN `published_ms` switched the in-flight
    accounting off for the endpoint in silence, and a dict given as the state failed as an AttributeError."""
    with pytest.raises(ValueError, match=f"^{named}: "):
        Candidate(EndpointState("a"), **options)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state must be an EndpointState, got dict"):
        Candidate({"endpoint_id": "a"})  # type: ignore[arg-type]
