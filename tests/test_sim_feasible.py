"""The goodput ceiling: which requests could meet their SLOs with the fleet to themselves."""

from __future__ import annotations

import pytest

from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.feasible import ceiling_goodput_rps, servable_alone
from leadtime.simulator.fleet import Fleet, parse_fleet
from leadtime.simulator.run import make_policy
from leadtime.simulator.workload import WorkloadRequest

MODEL = "llama-3.1-8b"


def _fleet(*pools: dict[str, object], jitter: float = 0.0) -> Fleet:
    return parse_fleet({"pools": list(pools), "realism": {"step_jitter": jitter, "speed_spread": 0.0}})


def _alone_ttft_ms(fleet: Fleet, request: WorkloadRequest) -> float:
    result = FleetSimulator(fleet, [request], make_policy("round_robin", 0, fleet)).run()
    return result.completed[0].ttft_ms


def test_the_bound_is_the_simulators_own_ttft_of_a_request_alone() -> None:
    fleet = _fleet({"name": "h", "count": 1, "accelerator": "h100-sxm", "model": MODEL})
    request = WorkloadRequest(0.0, 20_000, 50)  # three chunks of the 8,192-token budget
    alone = _alone_ttft_ms(fleet, request)
    assert servable_alone(fleet, [request], ttft_slo_ms=alone * 1.001) == [True]
    assert servable_alone(fleet, [request], ttft_slo_ms=alone * 0.999) == [False]


def test_a_prefix_any_earlier_request_carried_counts_as_cached() -> None:
    fleet = _fleet({"name": "h", "count": 1, "accelerator": "h100-sxm", "model": MODEL})
    segments = tuple(range(1, 31))  # 30 segments of 512 tokens
    first = WorkloadRequest(0.0, 15_360, 20, segments)
    again = WorkloadRequest(60_000.0, 15_360, 20, segments)  # after the first is long done
    uncached = _alone_ttft_ms(fleet, first)
    cached = FleetSimulator(fleet, [first, again], make_policy("round_robin", 0, fleet)).run().completed[1].ttft_ms
    assert cached < uncached / 5
    slo = (cached + uncached) / 2
    assert servable_alone(fleet, [first, again], ttft_slo_ms=slo) == [False, True]
    # The whole prompt cached still leaves its last segment to compute, as the engine does.
    assert servable_alone(fleet, [first, again], ttft_slo_ms=cached * 0.999) == [False, False]


def test_an_endpoint_counts_only_for_requests_that_arrive_after_it_joins() -> None:
    fleet = _fleet(
        {"name": "slow", "count": 1, "accelerator": "l40s", "model": MODEL},
        {"name": "fast", "count": 1, "accelerator": "h200-sxm", "model": MODEL, "join_at_s": 10},
    )
    before, after = WorkloadRequest(0.0, 8_000, 20), WorkloadRequest(20_000.0, 8_000, 20)
    slow = _alone_ttft_ms(_fleet({"name": "slow", "count": 1, "accelerator": "l40s", "model": MODEL}), before)
    fast = _alone_ttft_ms(_fleet({"name": "fast", "count": 1, "accelerator": "h200-sxm", "model": MODEL}), before)
    assert fast < slow
    assert servable_alone(fleet, [before, after], ttft_slo_ms=(fast + slow) / 2) == [False, True]


def test_an_itl_slo_below_the_request_decoding_alone_is_out_of_reach() -> None:
    fleet = _fleet({"name": "h", "count": 1, "accelerator": "h100-sxm", "model": MODEL})
    request = WorkloadRequest(0.0, 1_000, 100)
    itl = FleetSimulator(fleet, [request], make_policy("round_robin", 0, fleet)).run().completed[0].itl_ms
    assert servable_alone(fleet, [request], tpot_slo_ms=itl * 1.05) == [True]
    assert servable_alone(fleet, [request], tpot_slo_ms=itl * 0.95) == [False]
    # One output token has no ITL to miss.
    assert servable_alone(fleet, [WorkloadRequest(0.0, 1_000, 1)], tpot_slo_ms=itl * 0.5) == [True]


@pytest.mark.parametrize("policy", ["round_robin", "least_queue", "clairvoyant", "leadtime"])
def test_no_policy_passes_the_ceiling(policy: str) -> None:
    fleet = _fleet(
        {"name": "h", "count": 2, "accelerator": "h100-sxm", "model": MODEL},
        {"name": "l", "count": 1, "accelerator": "l40s", "model": MODEL},
    )
    workload = [WorkloadRequest(i * 250.0, 1_000 + (i * 7919) % 24_000, 30 + i % 200) for i in range(120)]
    slos = (500.0, 60.0)
    ceiling = ceiling_goodput_rps(fleet, workload, 0, *slos)
    result = FleetSimulator(
        fleet, workload, make_policy(policy, 0, fleet), ttft_slo_ms=slos[0], tpot_slo_ms=slos[1]
    ).run()
    assert sum(servable_alone(fleet, workload, 0, *slos)) < len(workload)  # some are out of reach here
    assert 0 < result.goodput_rps <= ceiling
