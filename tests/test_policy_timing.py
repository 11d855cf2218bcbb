"""The per-policy decision-time benchmark runs every policy it offers, the learning ones included."""

from __future__ import annotations

import pytest

from leadtime.bench.policy_timing import time_policy


@pytest.mark.parametrize("policy", ["round_robin", "llmd_predicted", "leadtime"])
def test_each_policy_is_timed_on_the_fleet_it_routes(policy: str) -> None:
    out = time_policy("homogeneous", 60, 1.0, policy)
    assert out["policy"] == policy and out["requests"] == 60
    decision = out["decision_ms"]
    assert isinstance(decision, dict) and 0.0 < decision["p50"] <= decision["p99"] <= decision["max"]
