"""The per-policy decision-time benchmark runs every policy it offers, the learning ones included."""

from __future__ import annotations

import pytest

from leadtime.bench.policy_timing import Timed, time_policy
from leadtime.features.rows import EndpointState
from leadtime.router_plugin.peers.dynamo_kv import DynamoKvPolicy
from leadtime.router_plugin.policy import Candidate, RouteRequest


@pytest.mark.parametrize("policy", ["round_robin", "llmd_predicted", "leadtime"])
def test_each_policy_is_timed_on_the_fleet_it_routes(policy: str) -> None:
    out = time_policy("homogeneous", 60, 1.0, policy)
    assert out["policy"] == policy and out["requests"] == 60
    decision = out["decision_ms"]
    assert isinstance(decision, dict) and 0.0 < decision["p50"] <= decision["p99"] <= decision["max"]


def test_a_timed_policy_is_told_of_first_tokens_and_failures() -> None:
    """Timed, a peer was never told of a first token or a failed request: Dynamo's prefill worker held every
    sequence until it completed, and a failed one for ever, so its goodput was not the benchmark's."""
    dynamo = DynamoKvPolicy()
    timed = Timed(dynamo)
    pair = [Candidate(EndpointState("p", role="prefill")), Candidate(EndpointState("d", role="decode"))]
    timed.pick(RouteRequest("r", 1600), pair)
    timed.prefilled("r", 10.0)
    assert (dynamo.active_blocks("p"), dynamo.active_blocks("d")) == (0.0, 100.0)
    timed.abandon("r")
    assert dynamo.active_blocks("d") == 0.0
