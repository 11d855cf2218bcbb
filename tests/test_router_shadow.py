"""A plain policy routing while Leadtime's predictor predicts its picks and learns (`router_plugin.shadow`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
from test_router_plugin import Answering, QueueModel, cand, req

from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.router_plugin.client import InProcessPredictor
from leadtime.router_plugin.config import ConfigError
from leadtime.router_plugin.gateway.serve import RouteOptions, build_gateway, needs_predictor
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.router_plugin.predicted import LeadtimePolicy
from leadtime.router_plugin.shadow import ShadowLearning
from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.learning_policies import shadow_policy
from leadtime.simulator.workload import WorkloadRequest


def outcome(rid: str, endpoint: str, decode: str | None = None, tokens: int = 10) -> Outcome:
    return Outcome(rid, endpoint, decode, ttft_ms=250.0, itl_ms=12.0, output_tokens=tokens, completed_ms=5000.0)


def test_the_plain_policy_decides_and_its_pick_is_predicted_and_learned() -> None:
    model = QueueModel()
    shadow = ShadowLearning(RoundRobinPolicy(), model)
    alone = RoundRobinPolicy()
    candidates = [cand("a", waiting=5), cand("b"), cand("c", running=3)]
    for i in range(6):
        pick = shadow.pick(req(f"r{i}"), candidates)
        assert pick.endpoint_id == alone.pick(req(f"r{i}"), candidates).endpoint_id  # the baseline's choice
        assert pick.row is not None and pick.row.endpoint.endpoint_id == pick.endpoint_id
        assert pick.predicted_ttft_ms is not None and pick.predicted_tpot_ms is not None
    assert [len(rows) for rows in model.asked] == [1] * 6  # one row a decision: the endpoint picked
    shadow.observe(outcome("r0", "a"))
    shadow.observe(outcome("r1", "b", tokens=1))  # one token: no ITL to learn
    (first, second) = model.told
    assert (first.row.endpoint.endpoint_id, first.actual_ttft_ms, first.actual_tpot_ms) == ("a", 250.0, 12.0)
    assert first.predicted_ttft_ms is not None and first.predicted_ttft_quantile_ms is not None
    assert (second.actual_tpot_ms, second.predicted_tpot_ms) == (0.0, None)
    assert shadow.shadow_counters.learned == 2 and shadow.name == "round_robin_shadow"


def test_on_a_pd_fleet_only_the_decode_endpoints_itl_is_learned() -> None:
    model = QueueModel()
    shadow = ShadowLearning(RoundRobinPolicy(), model)
    candidates = [cand("p0", role="prefill"), cand("d0", role="decode")]
    pick = shadow.pick(req("r1"), candidates)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p0", "d0")
    assert pick.decode_row is not None and pick.predicted_ttft_ms is None and pick.predicted_tpot_ms is not None
    shadow.observe(outcome("r1", "p0", "d0"))
    (told,) = model.told
    assert told.row.endpoint.endpoint_id == "d0" and (told.actual_ttft_ms, told.actual_tpot_ms) == (0.0, 12.0)


@pytest.mark.parametrize(
    "model",
    [lambda: QueueModel(fail=True), lambda: Answering([math.nan]), lambda: Answering([math.inf]),
     lambda: Answering([2e12])],
    ids=["failed", "nan", "inf", "beyond the bound"],
)  # fmt: skip
def test_a_prediction_failed_or_no_number_costs_the_decision_nothing_and_the_outcome_is_still_learned(
    model: Callable[[], QueueModel],
) -> None:
    """A prediction that fails is skipped; so is an answer that is no prediction (regression: a NaN answer, a
    native answer's null or gRPC's NaN, was carried by the pick, and the outcome's `observe` raised FeatureError:
    never learned)."""
    predictor = model()
    shadow = ShadowLearning(RoundRobinPolicy(), predictor)
    pick = shadow.pick(req("r1"), [cand("a"), cand("b")])
    assert pick.endpoint_id == "a" and pick.predicted_ttft_ms is None
    shadow.observe(outcome("r1", "a"))
    assert predictor.told[0].predicted_ttft_ms is None and predictor.told[0].actual_ttft_ms == 250.0
    assert (shadow.shadow_counters.unpredicted, shadow.shadow_counters.learned) == (1, 1)


class Holding(RoundRobinPolicy):
    """Holds every first offer; remembers what it was told to forget."""

    def __init__(self) -> None:
        super().__init__()
        self.forgot: list[str] = []

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        return Pick.held() if not request.held_ms else super().pick(request, candidates)

    def abandon(self, request_id: str) -> None:
        self.forgot.append(request_id)


def test_a_held_request_is_not_predicted_and_an_abandoned_one_is_not_learned() -> None:
    model, baseline = QueueModel(), Holding()
    shadow = ShadowLearning(baseline, model)
    assert shadow.pick(req("r1"), [cand("a")]).hold and model.asked == []
    shadow.abandon("r1")
    shadow.observe(outcome("r1", "a"))
    assert model.told == [] and baseline.forgot == ["r1"]


class Hooked(RoundRobinPolicy):
    """Has the contract's optional hooks; remembers what it was told through them."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, object]] = []

    def prefilled(self, request_id: str, now_ms: float) -> None:
        self.told.append(("prefilled", request_id))

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.told.append(("forget_endpoint", endpoint_id))


def test_the_optional_hooks_reach_the_shadowed_policy() -> None:
    """They were not passed on: a shadowed Dynamo kept a request's blocks on its prefill worker until it completed."""
    baseline = Hooked()
    shadow = ShadowLearning(baseline, QueueModel())
    shadow.pick(req("r1"), [cand("a")])
    shadow.prefilled("r1", 100.0)
    shadow.forget_endpoint("a")
    assert baseline.told == [("prefilled", "r1"), ("forget_endpoint", "a")]
    ShadowLearning(RoundRobinPolicy(), QueueModel()).prefilled("r1", 100.0)  # a baseline without them: nothing to do


def test_in_the_simulator_the_shadowed_policy_routes_as_the_plain_one_and_its_picks_carry_predictions() -> None:
    fleet = parse_fleet(
        {"name": "two", "pools": [{"name": "h", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]}
    )
    work = [WorkloadRequest(arrival_ms=40.0 * i, input_tokens=300 + 50 * i, output_tokens=8) for i in range(30)]
    plain = FleetSimulator(fleet, work, RoundRobinPolicy()).run()
    shadowed = FleetSimulator(fleet, work, shadow_policy("round_robin_shadow", fleet)).run()
    assert [c.endpoint_id for c in shadowed.completed] == [c.endpoint_id for c in plain.completed]
    assert [c.ttft_ms for c in shadowed.completed] == [c.ttft_ms for c in plain.completed]
    assert all(o.predicted_ttft_ms is not None for o in shadowed.observations)


def test_the_gateway_shadows_llmd_heuristic_profile_and_refuses_to_shadow_a_predicting_one() -> None:
    options = RouteOptions(endpoints=("127.0.0.1:1",), profile="heuristic", shadow=True)
    assert needs_predictor(options)
    predictor = InProcessPredictor(OnlinePredictor(LearnerConfig(background=False)))
    gateway = build_gateway(options, predictor, remote=False)
    assert isinstance(gateway.policy, ShadowLearning)
    assert not isinstance(gateway.policy.baseline, LeadtimePolicy)
    with pytest.raises(ConfigError, match="routes on predictions"):
        needs_predictor(RouteOptions(endpoints=("127.0.0.1:1",), shadow=True))
