"""Batching, prefix caching and preemption invariants; P/D transfers; time-slicing; determinism."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from leadtime.features.catalog import get_model
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.simulator.cli import failure_warnings
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.engine import FleetSimulator, SimulationError, pools_never_joining
from leadtime.simulator.fleet import DAY_MS, FleetError, late_pools, parse_fleet
from leadtime.simulator.kvcache import KVCache
from leadtime.simulator.report import summarize
from leadtime.simulator.run import make_policy, run_policies
from leadtime.simulator.steptime import StepTimeModel
from leadtime.simulator.workload import SyntheticSpec, WorkloadRequest, synthetic


def _fleet(pool: dict[str, object] | None = None, **extra: object) -> dict[str, object]:
    spec: dict[str, object] = {"name": "h100", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}
    spec.update(pool or {})
    return {"pools": [spec], **extra}


def _endpoint(total_blocks: int, block_size: int = 16, max_tokens: int = 512) -> Endpoint:
    stepper = StepTimeModel("h100-sxm", get_model("llama-3.1-8b"))
    return Endpoint("e0", "both", stepper, KVCache(total_blocks, block_size), max_tokens, 64)


def _blocks_conserved(e: Endpoint) -> None:
    """Every used block is owned by a request or a prefix entry, never negative, never over capacity."""
    cache = e.cache
    private = sum(r.private_blocks for r in e.running)
    assert cache.private_blocks == private
    assert cache.prefix_blocks == sum(entry.blocks for entry in cache.entries.values())
    assert 0 <= cache.used_blocks <= cache.total_blocks
    refs = {h: 0 for h in cache.entries}
    for r in e.running:
        for h in r.held:
            refs[h] += 1
    assert all(cache.entries[h].refs == n for h, n in refs.items())
    assert cache.evictable_blocks == sum(x.blocks for x in cache.entries.values() if x.refs == 0)


def _drain(e: Endpoint, requests: list[SimRequest]) -> float:
    for r in requests:
        e.enqueue(r)
    clock = 0.0
    finished: list[SimRequest] = []
    while e.waiting or e.running:
        plan = e.start_step(clock)
        assert plan is not None, "endpoint stalled with work queued"
        budget = sum(n for _, n in plan.entries)
        assert plan.decode_run or budget <= e.max_batched_tokens
        clock = plan.end_ms
        finished += e.finish_step().finished
        _blocks_conserved(e)
    assert sorted(r.rid for r in finished) == sorted(r.rid for r in requests)
    for r in requests:
        assert r.generated == r.output_tokens  # no token lost, none extra
        assert r.first_token_ms is not None and r.finish_ms is not None
        assert r.arrival_ms <= r.first_token_ms <= r.finish_ms
    assert e.cache.private_blocks == 0
    return clock


def test_chunked_prefill_respects_token_budget_and_finishes_everything() -> None:
    e = _endpoint(total_blocks=4000, max_tokens=256)
    requests = [SimRequest(i, 0.0, 700 + 37 * i, 5 + i) for i in range(6)]
    _drain(e, requests)


def test_preemption_under_a_small_cache_loses_no_token() -> None:
    e = _endpoint(total_blocks=120)  # 1920 tokens: cannot hold all six at once
    requests = [SimRequest(i, 0.0, 400, 300) for i in range(6)]
    _drain(e, requests)
    assert e.preemptions > 0
    assert any(r.preemptions for r in requests)


def test_prefix_cache_hits_and_lru_eviction() -> None:
    e = _endpoint(total_blocks=200, block_size=16)
    shared = (11, 12)
    first = SimRequest(0, 0.0, 1100, 2, shared + (13,), 512)
    _drain(e, [first])
    assert first.prefix_hit_tokens == 0
    assert e.cache.matched_prefix(shared) == 2  # kept, unreferenced, after the request finished
    second = SimRequest(1, 0.0, 1100, 2, shared + (14,), 512)
    _drain(e, [second])
    assert second.prefix_hit_tokens == 1024
    # A stranger that needs the whole cache evicts the unreferenced prefix.
    big = SimRequest(2, 0.0, 3000, 2)
    _drain(e, [big])
    assert e.cache.matched_prefix(shared) < 2


def test_decode_runs_equal_single_steps() -> None:
    def finish_times(decode_runs: bool) -> list[float]:
        e = _endpoint(total_blocks=5000)
        e.decode_runs = decode_runs
        requests = [SimRequest(i, 0.0, 300, 50 + 20 * i) for i in range(4)]
        _drain(e, requests)
        return [r.finish_ms or 0.0 for r in requests]

    assert finish_times(True) == pytest.approx(finish_times(False), rel=1e-9)


def test_interrupting_a_decode_run_keeps_blocks_consistent() -> None:
    e = _endpoint(total_blocks=5000)
    r = SimRequest(0, 0.0, 100, 400)
    e.enqueue(r)
    plan = e.start_step(0.0)
    assert plan is not None
    e.finish_step()
    plan = e.start_step(plan.end_ms)
    assert plan is not None and plan.decode_run > 10
    start = plan.start_ms
    assert e.interrupt(start + 1e-6)
    assert plan.decode_run == 1
    e.finish_step()
    _blocks_conserved(e)
    assert r.generated == 2


def _run(
    fleet_doc: dict[str, object], workload: list[WorkloadRequest], policy: str = "round-robin", seed: int = 0
) -> FleetSimulator:
    sim = FleetSimulator(parse_fleet(fleet_doc), workload, make_policy(policy, seed), seed=seed)
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_determinism_per_seed() -> None:
    fleet = parse_fleet(_fleet(pool={"count": 3}))
    workload = synthetic(SyntheticSpec(requests=150, rate_rps=20, burstiness=3.0), seed=3)
    a = run_policies(fleet, workload, ["llm-d", "random"])
    b = run_policies(fleet, workload, ["llm-d", "random"])
    for x, y in zip(a, b, strict=True):
        assert [(c.ttft_ms, c.itl_ms, c.endpoint_id) for c in x.completed] == [
            (c.ttft_ms, c.itl_ms, c.endpoint_id) for c in y.completed
        ]
    other = synthetic(SyntheticSpec(requests=150, rate_rps=20, burstiness=3.0), seed=4)
    c = run_policies(fleet, other, ["random"])[0]
    assert [x.ttft_ms for x in c.completed] != [x.ttft_ms for x in a[1].completed]


def test_observations_arrive_at_completion_with_decision_time_features() -> None:
    class Recorder(RoundRobinPolicy):
        def __init__(self, simulator_now: list[float]) -> None:
            super().__init__()
            self.seen: list[tuple[float, float]] = []
            self.clock = simulator_now

        def attach(self, sim: FleetSimulator) -> None:
            self.sim = sim

        def observe(self, outcome: Outcome) -> None:
            self.seen.append((self.sim.now, outcome.completed_ms))

    workload = [WorkloadRequest(i * 10.0, 500, 20) for i in range(10)]
    policy = Recorder([])
    sim = FleetSimulator(parse_fleet(_fleet()), workload, policy)
    result = sim.run()
    assert len(policy.seen) == 10
    assert all(now == pytest.approx(stamp) for now, stamp in policy.seen)
    for obs, done in zip(
        result.observations, sorted(result.completed, key=lambda c: c.arrival_ms + c.e2e_ms), strict=True
    ):
        assert obs.actual_ttft_ms > 0 and obs.actual_tpot_ms > 0
        assert obs.timestamp is not None and obs.timestamp * 1e3 >= done.arrival_ms + obs.actual_ttft_ms - 1e-6
    assert result.observations[0].row.request.input_tokens == 500


def test_router_sees_stale_state() -> None:
    # Ten requests in one millisecond: the published state cannot show the ones just routed.
    workload = [WorkloadRequest(i * 0.1, 2000, 50) for i in range(10)]
    sim = FleetSimulator(parse_fleet(_fleet(refresh_ms=50)), workload, make_policy("least-queue"))
    result = sim.run()
    counts = [o.row.endpoint.num_request_waiting + o.row.endpoint.num_request_running for o in result.observations]
    assert max(counts) == 0


def test_pd_transfer_time_is_visible_and_grows_with_prompt() -> None:
    doc = {
        "kv_link_gb_s": 5,
        "pools": [
            {"name": "p", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
            {"name": "d", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
        ],
    }
    workload = [WorkloadRequest(0.0, 1000, 20), WorkloadRequest(5000.0, 8000, 20)]
    result = FleetSimulator(parse_fleet(doc), workload, make_policy("llm-d")).run()
    small, large = result.completed
    kv_per_token = get_model("llama-3.1-8b").kv_bytes_per_token(1)
    assert small.transfer_ms == pytest.approx(1000 * kv_per_token / 5e9 * 1e3)
    assert large.transfer_ms > small.transfer_ms
    assert small.ttft_ms > small.transfer_ms
    assert small.decode_endpoint_id == "d-0" and small.endpoint_id == "p-0"
    # Two observations per request: TTFT on the prefill row, ITL on the decode row.
    roles = [(o.row.endpoint.role, o.has_ttft, o.has_tpot) for o in result.observations]
    assert roles.count(("prefill", True, False)) == 2 and roles.count(("decode", False, True)) == 2


def test_pd_link_contention_queues_transfers() -> None:
    doc = {
        "kv_link_gb_s": 1,
        "pools": [
            {"name": "p", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
            {"name": "d", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
        ],
    }
    workload = [WorkloadRequest(0.0, 4000, 5), WorkloadRequest(0.0, 4000, 5)]
    result = FleetSimulator(parse_fleet(doc), workload, make_policy("round-robin")).run()
    alone = 4000 * get_model("llama-3.1-8b").kv_bytes_per_token(1) / 1e9 * 1e3
    transfers = sorted(c.transfer_ms for c in result.completed)
    assert transfers[0] == pytest.approx(alone)
    assert transfers[1] > 1.5 * alone  # waited for the first transfer on the shared link


def test_timeslice_unavailability_shows_in_latency() -> None:
    base = _fleet(pool={"count": 1})
    sliced = _fleet(
        pool={"count": 1, "timeslice_group": "rl"},
        timeslice_groups={
            "rl": {
                "resident_ms": {"distribution": "fixed", "value": 200},
                "away_ms": {"distribution": "fixed", "value": 1000},
                "restore_ms": {"distribution": "fixed", "value": 80},
            }
        },
    )
    workload = [WorkloadRequest(i * 100.0, 300, 30) for i in range(30)]
    free = FleetSimulator(parse_fleet(base), workload, make_policy("round-robin")).run()
    shared = FleetSimulator(parse_fleet(sliced), workload, make_policy("round-robin")).run()
    worst_free = max(c.ttft_ms for c in free.completed)
    worst_shared = max(c.ttft_ms for c in shared.completed)
    assert worst_shared > worst_free + 500
    states = [s for _, s in shared.timeslice["rl"]]
    assert states[:4] == ["resident", "parked", "switching", "resident"]
    parked = [o for o in shared.observations if o.row.endpoint.timeslice_state == "parked"]
    # Routers see that the group is away, not when it will be back (only the orchestrator's status is public).
    assert parked and all(o.row.endpoint.timeslice_wait_ms == 0 for o in parked)


def test_clairvoyant_ttft_is_exact_for_an_idle_endpoint() -> None:
    workload = [WorkloadRequest(0.0, 3000, 2)]
    sim = FleetSimulator(parse_fleet(_fleet()), workload, make_policy("clairvoyant"))
    predicted = sim.policy.exact_ttft_ms  # type: ignore[attr-defined]
    result = sim.run()
    assert predicted(RouteRequest("x", 3000), "h100-0") == pytest.approx(result.completed[0].ttft_ms)


def test_clairvoyant_beats_random_on_a_mixed_fleet() -> None:
    doc = {
        "pools": [
            {"name": "fast", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "slow", "count": 2, "accelerator": "l40s", "model": "llama-3.1-8b"},
        ]
    }
    rng = random.Random(1)
    workload = [WorkloadRequest(i * 150.0, rng.randint(1000, 6000), 30) for i in range(80)]
    fleet = parse_fleet(doc)
    clair, rand = run_policies(fleet, workload, ["clairvoyant", "random"])
    mean = lambda r: sum(c.ttft_ms for c in r.completed) / len(r.completed)  # noqa: E731
    assert mean(clair) < mean(rand)


def test_fleet_errors_name_the_problem() -> None:
    with pytest.raises(FleetError, match="pools"):
        parse_fleet({"pools": []})
    with pytest.raises(FleetError, match="accelerator"):
        parse_fleet(_fleet(pool={"accelerator": "b200"}))
    with pytest.raises(FleetError, match="does not fit"):
        parse_fleet(_fleet(pool={"accelerator": "l40s", "model": "llama-3.1-70b"}))
    with pytest.raises(FleetError, match="timeslice_group"):
        parse_fleet(_fleet(pool={"timeslice_group": "nope"}))
    with pytest.raises(FleetError, match="unified"):
        parse_fleet(
            {
                "pools": [
                    {"name": "a", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
                    {"name": "b", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
                ]
            }
        )
    with pytest.raises(FleetError, match="count"):
        parse_fleet(_fleet(pool={"count": 0}))


def test_fleet_settings_vllm_would_refuse_are_refused_as_vllm_does() -> None:
    """A block size vLLM has no kernel for, a tensor-parallel size that splits no model's heads evenly, and a
    memory share too small for the weights (which blamed tensor_parallel alone) are caught where the fleet is read,
    not at the first request of a run."""
    with pytest.raises(FleetError, match="block_size: Input should be 1, 8, 16, 32, 64 or 128, got 48"):
        parse_fleet(_fleet(pool={"block_size": 48}))
    with pytest.raises(FleetError, match="tensor_parallel 3 does not divide llama-3.1-8b's 32 attention heads"):
        parse_fleet(_fleet(pool={"tensor_parallel": 3}))
    with pytest.raises(FleetError, match="raise gpu_memory_utilization .0.2. or tensor_parallel"):
        parse_fleet(_fleet(pool={"gpu_memory_utilization": 0.2, "model": "qwen3-32b"}))
    with pytest.raises(FleetError, match="timeslice_groups.spare: no pool names it"):
        group = {"distribution": "exponential", "mean": 8000}
        parse_fleet(_fleet(timeslice_groups={"spare": {"resident_ms": group, "away_ms": group}}))
    with pytest.raises(FleetError, match="same model, got llama-3.1-8b, qwen3-32b"):
        parse_fleet(
            {
                "pools": [
                    {"name": "p", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
                    {"name": "d", "count": 1, "accelerator": "h200-sxm", "model": "qwen3-32b", "role": "decode"},
                ]
            }
        )


SMALL_KV_FLEET = {
    "pools": [
        {"name": "big", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
        {
            "name": "small",
            "count": 1,
            "accelerator": "h100-sxm",
            "model": "llama-3.1-8b",
            "gpu_memory_utilization": 0.25,
        },
    ]
}  # small-0 holds 30,048 tokens, big-0 over 400,000


@pytest.mark.parametrize(
    "policy", ["leadtime", "profile:default", "llmd_predicted", "llm-d", "round-robin", "random", "dynamo_kv"]
)
def test_an_endpoint_whose_kv_cache_cannot_hold_a_request_is_never_offered_it(policy: str) -> None:
    fleet = parse_fleet(SMALL_KV_FLEET)
    long = [0, 3, 6, 9]  # 36,000 tokens: small-0 would have to refuse them
    workload = [WorkloadRequest(i * 40.0, 36_000 if i in long else 400, 16) for i in range(12)]
    result = FleetSimulator(fleet, workload, make_policy(policy, 0, fleet)).run()
    assert len(result.completed) == 12 and not result.failed
    assert {c.endpoint_id for c in result.completed if c.rid in long} == {"big-0"}
    # Prompt plus output: 30,000 + 100 fits no more than 30,048 once its output is counted.
    result = FleetSimulator(fleet, [WorkloadRequest(0.0, 30_000, 100)] * 2, make_policy(policy, 0, fleet)).run()
    assert {c.endpoint_id for c in result.completed} == {"big-0"}


def test_a_request_no_endpoint_can_hold_fails_for_that_policy_with_the_reason_and_the_run_goes_on() -> None:
    doc = _fleet(pool={"gpu_memory_utilization": 0.21})
    workload = [WorkloadRequest(0.0, 100_000, 10), WorkloadRequest(5.0, 200, 10)]
    result = FleetSimulator(parse_fleet(doc), workload, make_policy("random")).run()
    assert [c.rid for c in result.completed] == [1]
    assert [f.rid for f in result.failed] == [0]
    assert "no endpoint's KV cache can hold the request's 100,010 tokens" in result.failed[0].reason
    summary = summarize(result)
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert summary["slo_attainment"] == 0.5  # a failed request met no SLO


def test_failures_are_grouped_by_kind_with_a_count_and_one_example() -> None:
    """Reasons name the request and its tokens, so counting by reason made one key per failed request: the report
    counts them by kind (`kv_cache`, `stuck`) with one example, and the warning names the count of each."""
    doc = _fleet(pool={"gpu_memory_utilization": 0.21})
    workload = [WorkloadRequest(i * 5.0, 100_000 + i, 10) for i in range(3)] + [WorkloadRequest(20.0, 200, 10)]
    result = FleetSimulator(parse_fleet(doc), workload, make_policy("random")).run()
    assert [f.kind for f in result.failed] == ["kv_cache"] * 3
    failures = summarize(result)["failures"]
    assert isinstance(failures, dict) and list(failures) == ["kv_cache"] and failures["kv_cache"]["count"] == 3
    assert failures["kv_cache"]["example"] == result.failed[0].reason
    stuck = FleetSimulator(parse_fleet(TIMESLICED_RL), STARVED, make_policy("round-robin"), ttft_slo_ms=1e9).run()
    assert [f.kind for f in stuck.failed] == ["stuck"]
    report: dict[str, object] = {"policies": {"random": summarize(result), "round_robin": summarize(stuck)}}
    first, second = failure_warnings(report)
    assert first.startswith("policy random: 3 request(s) could not be served and count as failed (SLO missed): ")
    assert "3 kv_cache (e.g. no endpoint's KV cache can hold the request's 100,010 tokens" in first
    assert "other reasons" not in first and "100,011" not in first
    assert "1 stuck (e.g. request 0 (100000 prompt tokens) was preempted" in second


def test_a_policy_picking_past_the_candidates_an_endpoint_too_small_is_named() -> None:
    class Stubborn(RoundRobinPolicy):
        name = "stubborn"

        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            return Pick("small-0")

    named = r"policy 'stubborn' picked small-0 for request 0 \(36010 tokens\).*never fit"
    with pytest.raises(SimulationError, match=named):
        FleetSimulator(parse_fleet(SMALL_KV_FLEET), [WorkloadRequest(0.0, 36_000, 10)], Stubborn()).run()


TIMESLICED_RL = _fleet(
    pool={"count": 1, "timeslice_group": "rl"},
    timeslice_groups={
        "rl": {
            "resident_ms": {"distribution": "fixed", "value": 1000},
            "away_ms": {"distribution": "fixed", "value": 1000},
            "restore_ms": {"distribution": "fixed", "value": 10},
        }
    },
)
STARVED = [WorkloadRequest(0.0, 100_000, 10), *(WorkloadRequest(5.0 + i, 100, 5) for i in range(3))]
"""A prompt longer than the group's resident window can prefill, and three short ones."""


def test_a_request_that_can_never_finish_is_counted_as_failed_and_the_others_complete() -> None:
    """A prompt longer than the group's resident window can prefill is restarted at every swap: it fails, alone."""
    result = FleetSimulator(parse_fleet(TIMESLICED_RL), STARVED, make_policy("round-robin"), ttft_slo_ms=1e9).run()
    assert [f.rid for f in result.failed] == [0]
    assert "preempted" in result.failed[0].reason and "h100-0" in result.failed[0].reason
    assert sorted(c.rid for c in result.completed) == [1, 2, 3]
    summary = summarize(result)
    assert summary["failed"] == 1 and summary["completed"] == 3
    assert summary["slo_attainment"] == 0.75  # the failed request missed its SLO


def test_the_serving_jobs_name_in_a_configuration_does_not_change_a_simulation() -> None:
    """`servingJob` names the inference job as a real orchestrator reports it; the simulated one calls it its own
    way. With `servingJob: vllm`, a predicted profile took every time-sliced endpoint as away for good."""
    from leadtime.router_plugin.config import parse_config

    away = {"distribution": "fixed", "value": 1000}
    doc = {
        "pools": [
            {"name": "dedicated", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "shared", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "timeslice_group": "c"},
        ],
        "timeslice_groups": {"c": {"resident_ms": {"distribution": "fixed", "value": 3_600_000}, "away_ms": away}},
    }
    fleet = parse_fleet(doc)
    workload = [WorkloadRequest(i * 50.0, 2000, 50) for i in range(16)]
    placed = {}
    for job in ("inference", "vllm"):
        config = parse_config(
            {
                "plugins": [
                    {"type": "timeslice-filter", "parameters": {"servingJob": job}},
                    {"type": "predicted-latency-scorer"},
                ],
                "schedulingProfiles": [
                    {"plugins": [{"pluginRef": "timeslice-filter"}, {"pluginRef": "predicted-latency-scorer"}]}
                ],
            }
        )
        result = FleetSimulator(fleet, workload, make_policy("profile:default", 0, fleet, config)).run()
        placed[job] = sorted((c.rid, c.endpoint_id) for c in result.completed)
    assert any(endpoint == "shared-0" for _, endpoint in placed["inference"])
    assert placed["vllm"] == placed["inference"]


def test_a_request_unfinished_a_day_after_the_last_arrival_fails_and_the_run_ends_there() -> None:
    """A group away for a day (the longest a fleet file may say) took requests that needed many of its short
    resident windows: the run went on over weeks of simulated time, minutes of silence with other groups cycling.
    A request a client would have given up on so long ago fails, and the run stops a day after the last arrival."""
    away = {"distribution": "fixed", "value": DAY_MS}
    doc = {
        "pools": [
            {"name": "dedicated", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "shared", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "timeslice_group": "c"},
        ],
        "timeslice_groups": {"c": {"resident_ms": {"distribution": "fixed", "value": 1000}, "away_ms": away}},
    }
    workload = [WorkloadRequest(i * 10.0, 200, 2000) for i in range(4)]  # ~14 s of decoding each
    result = FleetSimulator(parse_fleet(doc), workload, make_policy("round-robin")).run()
    on_shared = sorted(c.rid for c in result.completed if c.endpoint_id == "shared-0")
    failed = sorted(f.rid for f in result.failed)
    assert failed and not on_shared and len(failed) + len(result.completed) == 4
    assert {f.kind for f in result.failed} == {"stuck"}
    assert "had not finished a day after the last arrival" in result.failed[0].reason
    assert "shared-0" in result.failed[0].reason
    assert result.duration_ms <= workload[-1].arrival_ms + DAY_MS


def test_a_failed_request_is_abandoned_by_the_policy_that_placed_it() -> None:
    """A policy counting what it sent (Leadtime's in-flight ledgers) must not count a failed request for good."""
    abandoned: list[str] = []

    class Counting(RoundRobinPolicy):
        def abandon(self, request_id: str) -> None:
            abandoned.append(request_id)

    FleetSimulator(parse_fleet(TIMESLICED_RL), STARVED, Counting(), ttft_slo_ms=1e9).run()
    assert abandoned == ["0"]


class FirstTokens(RoundRobinPolicy):
    """Round-robin recording, in order, each first token (`prefilled`) and each outcome it is told of."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, str, float]] = []

    def prefilled(self, request_id: str, now_ms: float) -> None:
        self.told.append(("prefilled", request_id, now_ms))

    def observe(self, outcome: Outcome) -> None:
        self.told.append(("observe", outcome.request_id, outcome.completed_ms))


@pytest.mark.parametrize("pd", [False, True], ids=["unified", "pd"])
def test_a_policy_is_told_of_each_first_token_when_the_client_gets_it(pd: bool) -> None:
    """Real routers release a request's prefill side when its stream starts (Dynamo frees the prefill worker's
    sequence, llm-d moves its tokens from prefill to decode): the policy must hear of it then, not at completion.
    On P/D the first token comes after the KV transfer."""
    pool = {"count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}
    pair: dict[str, object] = {
        "pools": [{**pool, "name": "p", "role": "prefill"}, {**pool, "name": "d", "role": "decode"}]
    }
    doc = pair if pd else _fleet()
    workload = [WorkloadRequest(0.0, 2000, 30), WorkloadRequest(1.0, 500, 1), WorkloadRequest(2.0, 800, 12)]
    policy = FirstTokens()
    result = FleetSimulator(parse_fleet(doc), workload, policy).run()
    first = {c.rid: c.arrival_ms + c.ttft_ms for c in result.completed}
    told = [(kind, rid) for kind, rid, _ in policy.told]
    for rid, at in first.items():
        assert ("prefilled", str(rid), pytest.approx(at)) in policy.told
        assert told.count(("prefilled", str(rid))) == 1
        assert told.index(("prefilled", str(rid))) < told.index(("observe", str(rid)))
    if pd:
        assert all(c.transfer_ms > 0 for c in result.completed)


def test_bad_policy_pick_is_reported() -> None:
    class Wrong(RoundRobinPolicy):
        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            return Pick("nowhere")

    with pytest.raises(SimulationError, match="unknown endpoint"):
        FleetSimulator(parse_fleet(_fleet()), [WorkloadRequest(0.0, 10, 2)], Wrong()).run()


def test_a_prefill_endpoint_is_held_to_the_prompt_alone_when_a_pair_is_placed() -> None:
    """It hands the request on after its first token: a prompt its cache holds is its to prefill, however long the
    reply (the engine's own check weighed prompt plus reply and stopped the run)."""
    doc = {
        "pools": [
            {
                "name": "p",
                "count": 1,
                "accelerator": "h100-sxm",
                "model": "llama-3.1-8b",
                "role": "prefill",
                "gpu_memory_utilization": 0.21,
            },
            {"name": "d", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
        ],
    }
    fleet = parse_fleet(doc)
    capacity = FleetSimulator(fleet, [], make_policy("round-robin")).by_id["p-0"].cache.capacity_tokens
    offered: list[str] = []

    class Pairs(RoundRobinPolicy):
        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            offered.extend(c.endpoint_id for c in candidates)
            return Pick("p-0", decode_endpoint_id="d-0")

    workload = [WorkloadRequest(0.0, capacity - 200, 1000)]
    result = FleetSimulator(fleet, workload, Pairs()).run()
    assert sorted(offered) == ["d-0", "p-0"] and len(result.completed) == 1 and not result.failed


def test_pd_decode_preemption_recomputes_and_loses_no_token() -> None:
    doc = {
        "pools": [
            {"name": "p", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
            {
                "name": "d",
                "count": 1,
                "accelerator": "h100-sxm",
                "model": "llama-3.1-8b",
                "role": "decode",
                "gpu_memory_utilization": 0.21,
            },
        ],
    }
    workload = [WorkloadRequest(i * 5.0, 1000, 800) for i in range(5)]
    sim = FleetSimulator(parse_fleet(doc), workload, make_policy("round-robin"))
    result = sim.run()
    assert len(result.completed) == 5
    assert sim.by_id["d-0"].preemptions > 0 and result.endpoints["d-0"]["preemptions"] == sim.by_id["d-0"].preemptions
    decode = sim.by_id["d-0"]
    assert decode.cache.private_blocks == 0 and decode.cache.used_blocks == decode.cache.prefix_blocks
    assert all(c.itl_ms > 0 for c in result.completed)


def test_eviction_frees_several_segments_for_one_large_allocation() -> None:
    cache = KVCache(total_blocks=100, block_size=16)
    cache.allocate(96)
    cache.publish_prefix([1, 2, 3], 32, 0.0)
    cache.release_prefix([1, 2, 3])
    assert cache.evictable_blocks == 96 and cache.free_blocks == 4
    assert cache.allocate(60)  # 4 free + two evicted segments of 32 = 68 ≥ 60
    assert cache.used_blocks <= cache.total_blocks
    assert len(cache.entries) == 1 and cache.evictable_blocks == 32 and cache.free_blocks == 8
    assert not cache.allocate(41)  # 8 + 32 < 41: nothing taken
    assert cache.used_blocks == 92 and 3 in cache.entries


def test_random_shared_prefix_traffic_keeps_cache_invariants() -> None:
    rng = random.Random(5)
    e = _endpoint(total_blocks=700, max_tokens=1024)
    requests = []
    for i in range(40):
        head = (rng.randrange(4), rng.randrange(3))
        segments = tuple(hash((head[:k], i if k > 2 else 0)) for k in range(1, 5))
        requests.append(SimRequest(i, 0.0, rng.randint(600, 2100), rng.randint(1, 120), segments, 512))
    _drain(e, requests)
    assert any(r.prefix_hit_tokens > 0 for r in requests)


def test_a_copied_request_has_every_field_and_its_own_held_segments() -> None:
    r = SimRequest(7, 12.5, 1300, 40, (11, 22, 33), 512, computed=1024, generated=3, published=2, held=[11, 22])
    r.first_token_ms, r.preemptions = 99.0, 1
    clone = r.copy()
    assert dataclasses.asdict(clone) == dataclasses.asdict(r)
    clone.held.append(33)
    clone.computed += 1
    assert r.held == [11, 22] and r.computed == 1024


def test_progress_reports_reach_the_total() -> None:
    calls: list[tuple[str, int, int]] = []
    workload = [WorkloadRequest(i * 50.0, 200, 4) for i in range(30)]
    run_policies(parse_fleet(_fleet()), workload, ["random"], progress=lambda p, n, t: calls.append((p, n, t)))
    assert calls and calls[-1] == ("random", 30, 30)


class _PublishedStateAuditor(RoundRobinPolicy):
    """Round-robin that checks, at every decision, each candidate's published state against the simulator's own.

    On a unified fleet without time-slicing every request sits in its endpoint's `waiting` or `running` from its
    arrival until it finishes, so the state published at instant P must count exactly the requests routed there
    before P that had not finished by P.
    """

    def __init__(self) -> None:
        super().__init__()
        self.routed: dict[str, list[SimRequest]] = {}
        self.checks = 0
        self.pending_checks = 0

    def attach(self, sim: FleetSimulator) -> None:
        self.sim = sim

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        sim = self.sim
        published_at = sim._published_at
        refresh = sim.fleet.refresh_ms
        assert sim.now - refresh < published_at <= sim.now
        for c in candidates:
            state = c.state
            endpoint = sim.by_id[c.endpoint_id]
            routed = self.routed.get(c.endpoint_id, [])
            at_publication = [
                r for r in routed if r.arrival_ms < published_at and (r.finish_ms is None or r.finish_ms > published_at)
            ]
            assert state.num_request_waiting + state.num_request_running == len(at_publication)
            # The symptom seen on the Mooncake replay: an endpoint holding a request that has waited a whole
            # refresh interval without a first token must not be published as idle.
            pending = [
                r
                for r in (*endpoint.waiting, *endpoint.running)
                if r.first_token_ms is None and sim.now - r.arrival_ms >= refresh
            ]
            if pending:
                self.pending_checks += 1
                assert state.num_request_waiting + state.num_request_running >= 1
                assert state.prefill_tokens_in_flight + state.decode_tokens_in_flight > 0
            assert 0.0 <= state.kv_cache_percentage <= 1.0
            assert (state.kv_cache_percentage > 0) == (state.num_request_running > 0)
            if state.num_request_waiting + state.num_request_running == 0:
                assert state.prefill_tokens_in_flight == 0 and state.decode_tokens_in_flight == 0
            self.checks += 1
        pick = super().pick(request, candidates)
        assert sim.routing is not None
        self.routed.setdefault(pick.endpoint_id, []).append(sim.routing)
        return pick


def test_published_state_is_the_state_at_the_last_publication() -> None:
    # Busy enough that queues form between publications; arrivals off the 50 ms grid so "before P" is unambiguous.
    workload = [
        dataclasses.replace(w, arrival_ms=w.arrival_ms + 0.37)
        for w in synthetic(
            SyntheticSpec(requests=300, rate_rps=30, burstiness=3.0, input_mean=3000, output_mean=60), seed=7
        )
    ]
    policy = _PublishedStateAuditor()
    sim = FleetSimulator(parse_fleet(_fleet(pool={"count": 3}, refresh_ms=50)), workload, policy)
    result = sim.run()
    assert len(result.completed) == 300
    assert policy.checks == 900
    assert policy.pending_checks > 50  # the invariant was exercised under load, not only on idle endpoints


def test_idle_endpoint_ttft_is_one_prefill_step() -> None:
    # Published idle and really idle: a small prompt waits for nothing but its own prefill step.
    workload = [WorkloadRequest(0.37, 1000, 10), WorkloadRequest(5000.37, 1000, 10)]
    sim = FleetSimulator(parse_fleet(_fleet(pool={"count": 1})), workload, make_policy("llm-d"))
    result = sim.run()
    one_step = sim.by_id["h100-0"].stepper.step_ms([(1000, 0)], 0, 0.0)
    assert 0 < one_step < 100  # an 8B model prefills 1000 tokens on an H100 in well under 100 ms
    for done, obs in zip(result.completed, result.observations, strict=True):
        assert obs.row.endpoint.num_request_waiting + obs.row.endpoint.num_request_running == 0
        assert done.ttft_ms == pytest.approx(one_step)


def test_same_instant_burst_queues_behind_requests_the_router_cannot_yet_see() -> None:
    # A burst at one instant (the Mooncake conversation trace's timestamps come in 3 s steps) shares one
    # publication: every member sees the endpoint idle, yet each queues behind the prefills routed before it.
    # One refresh later the whole burst is visible. This is stale state by design, not a publication bug.
    burst = [WorkloadRequest(10.3, 1500, 50) for _ in range(6)]
    probe = WorkloadRequest(10.3 + 50 + 1, 100, 5)
    sim = FleetSimulator(parse_fleet(_fleet(pool={"count": 1}, refresh_ms=50)), [*burst, probe], make_policy("llm-d"))
    result = sim.run()
    rows = {
        c.rid: o.row.endpoint
        for c, o in zip(
            sorted(result.completed, key=lambda c: c.arrival_ms + c.e2e_ms), result.observations, strict=True
        )
    }
    for rid in range(6):
        assert rows[rid].num_request_waiting + rows[rid].num_request_running == 0
    seen = rows[6]
    assert seen.num_request_waiting + seen.num_request_running == 6
    assert seen.prefill_tokens_in_flight >= 5 * 1500  # at least the five that queued are still prefilling
    ttfts = [c.ttft_ms for c in result.completed[:6]]
    one_step = sim.by_id["h100-0"].stepper.step_ms([(1500, 0)], 0, 0.0)
    assert ttfts[0] == pytest.approx(one_step)  # the first woke the idle endpoint and ran alone
    assert all(t > ttfts[0] + one_step for t in ttfts[1:])  # the rest waited for that step, then prefilled


# ------------------------------------------------------------------------------ routing-benchmark features


class _Scripted(RoundRobinPolicy):
    """Round-robin that records what it was offered and hands back a row and predictions with each pick."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[tuple[float, list[str]]] = []
        self.requests: list[RouteRequest] = []
        self.outcomes: list[Outcome] = []

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        self.offered.append((request.arrival_ms, [c.endpoint_id for c in candidates]))
        self.requests.append(request)
        chosen = super().pick(request, candidates)
        scored = dataclasses.replace(candidates[0].row(request), endpoint=candidates[0].state)
        return dataclasses.replace(chosen, row=scored, predicted_ttft_ms=123.0, predicted_tpot_ms=7.0)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def test_a_scaled_out_pool_is_offered_only_from_its_join_time_and_starts_empty() -> None:
    spec = {
        "pools": [
            {"name": "old", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "new", "count": 2, "accelerator": "h200-sxm", "model": "llama-3.1-8b", "join_at_s": 1.0},
        ]
    }
    fleet = parse_fleet(spec)
    assert fleet.join_ms == 1000.0
    workload = [WorkloadRequest(i * 100.0, 300, 5) for i in range(20)]
    policy = _Scripted()
    result = FleetSimulator(fleet, workload, policy).run()
    for arrival, offered in policy.offered:
        assert any(e.startswith("new") for e in offered) == (arrival >= 1000.0)
    assert result.join_ms == 1000.0
    # Each decision's time beside its cost: what tells the decisions on the grown fleet from the others.
    assert result.decision_at_ms == [at for at, _ in policy.offered] and len(result.decision_ms) == 20
    assert {c.endpoint_id for c in result.completed if c.arrival_ms >= 1000} & {"new-0", "new-1"}
    with pytest.raises(FleetError, match="from the start"):
        parse_fleet({"pools": [{**spec["pools"][1], "name": "only"}]})


@pytest.mark.parametrize("join_at_s", [1.9, 1.95, 100.0, 1e308, float("inf")])
def test_pools_that_join_after_the_last_arrival_are_named(join_at_s: float) -> None:
    """A scale-out pool joining after the last request arrived ran silently with 0 requests."""
    spec = {
        "pools": [
            {"name": "old", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "new", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "join_at_s": join_at_s},
            {"name": "half", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "join_at_share": 0.5},
        ]
    }
    fleet = parse_fleet(spec)
    workload = [WorkloadRequest(i * 100.0, 300, 5) for i in range(20)]  # the last at 1.9 s
    assert late_pools(fleet) == ["new", "half"]
    assert pools_never_joining(fleet, workload) == ([] if join_at_s <= 1.9 else ["new"])


def test_a_pool_can_join_at_a_share_of_the_arrival_window_whatever_the_rate() -> None:
    spec = {
        "pools": [
            {"name": "old", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "new", "count": 1, "accelerator": "h200-sxm", "model": "llama-3.1-8b", "join_at_share": 0.25},
        ]
    }
    fleet = parse_fleet(spec)
    for gap_ms in (100.0, 400.0):  # the same requests replayed at two rates
        workload = [WorkloadRequest(1000.0 + i * gap_ms, 300, 5) for i in range(21)]
        policy = _Scripted()
        result = FleetSimulator(fleet, workload, policy).run()
        assert result.join_ms == pytest.approx(1000.0 + 0.25 * 20 * gap_ms)
        for arrival, offered in policy.offered:
            assert ("new-0" in offered) == (arrival >= result.join_ms)
    with pytest.raises(FleetError, match="not both"):
        parse_fleet({"pools": [spec["pools"][0], {**spec["pools"][1], "join_at_s": 3}]})


def test_slo_classes_are_drawn_per_request_the_same_for_every_policy() -> None:
    fleet = parse_fleet(
        _fleet(slos=[{"share": 3, "ttft_ms": 500, "itl_ms": 40}, {"share": 1, "ttft_ms": 4000, "itl_ms": 120}])
    )
    classes = [fleet.slo_of(rid, 1.0, 1.0) for rid in range(4000)]
    assert set(classes) == {(500.0, 40.0), (4000.0, 120.0)}
    assert classes.count((500.0, 40.0)) / len(classes) == pytest.approx(0.75, abs=0.03)
    workload = [WorkloadRequest(i * 50.0, 200, 4) for i in range(12)]
    policy = _Scripted()
    result = FleetSimulator(fleet, workload, policy).run()
    assert [(r.ttft_slo_ms, r.tpot_slo_ms) for r in policy.requests] == [fleet.slo_of(i, 1, 1) for i in range(12)]
    assert all((c.ttft_slo_ms, c.itl_slo_ms) == fleet.slo_of(c.rid, 1, 1) for c in result.completed)
    # Without classes, the command's SLOs apply to every request.
    plain = FleetSimulator(parse_fleet(_fleet()), workload, _Scripted(), ttft_slo_ms=900, tpot_slo_ms=90).run()
    assert all((c.ttft_slo_ms, c.itl_slo_ms) == (900, 90) for c in plain.completed)


def test_picks_may_carry_the_rows_and_predictions_that_are_recorded() -> None:
    workload = [WorkloadRequest(i * 30.0, 400, 6) for i in range(8)]
    policy = _Scripted()
    result = FleetSimulator(parse_fleet(_fleet()), workload, policy).run()
    assert all(o.predicted_ttft_ms == 123.0 and o.predicted_tpot_ms == 7.0 for o in result.observations)
    assert all(o.row.endpoint.endpoint_id == "h100-0" for o in result.observations)  # the row handed back
    assert sorted(int(o.request_id) for o in policy.outcomes) == list(range(8))
    assert all(o.ttft_ms > 0 and o.itl_ms > 0 and o.output_tokens == 6 for o in policy.outcomes)


def test_step_noise_is_deterministic_mean_one_and_absent_by_default() -> None:
    workload = [WorkloadRequest(i * 40.0, 600, 30) for i in range(40)]
    plain = parse_fleet(_fleet())
    noisy = parse_fleet(_fleet(realism={"step_jitter": 0.2, "speed_spread": 0.1}))

    def ttfts(fleet: object, seed: int = 0) -> list[float]:
        return [c.ttft_ms for c in FleetSimulator(fleet, workload, RoundRobinPolicy(), seed=seed).run().completed]  # type: ignore[arg-type]

    assert ttfts(plain) == ttfts(plain, seed=5)  # no noise: the seed does not matter
    a, b = ttfts(noisy), ttfts(noisy)
    assert a == b and a != ttfts(plain)
    ratio = sum(a) / sum(ttfts(plain))
    assert 0.7 < ratio < 1.4


def test_a_pd_fleet_accepts_a_decode_endpoint_prefilling_locally() -> None:
    spec = {
        "pools": [
            {"name": "p", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
            {"name": "d", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
        ]
    }

    class Local(RoundRobinPolicy):
        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            return Pick("d-0")

    result = FleetSimulator(parse_fleet(spec), [WorkloadRequest(0.0, 300, 5)], Local()).run()
    (done,) = result.completed
    assert done.endpoint_id == "d-0" and done.decode_endpoint_id is None and done.transfer_ms == 0.0

    class Wrong(RoundRobinPolicy):
        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            return Pick("p-0")

    with pytest.raises(SimulationError, match="decode endpoint"):
        FleetSimulator(parse_fleet(spec), [WorkloadRequest(0.0, 300, 5)], Wrong()).run()


def test_trusted_state_is_the_validated_state_and_takes_every_field() -> None:
    from leadtime.features.rows import EndpointState
    from leadtime.simulator.engine import trusted_state

    values = {
        "endpoint_id": "e1",
        "accelerator": "l40s",
        "model": "llama-3.1-8b",
        "tensor_parallel": 2,
        "role": "decode",
        "num_request_waiting": 3,
        "num_request_running": 7,
        "kv_cache_percentage": 0.25,
        "prefill_tokens_in_flight": 100,
        "decode_tokens_in_flight": 50,
        "timeslice_state": "parked",
        "timeslice_wait_ms": 12.5,
    }
    assert {f.name for f in dataclasses.fields(EndpointState)} == set(values)
    assert trusted_state(**values) == EndpointState(**values)  # type: ignore[arg-type]
    # A field left out (say, one EndpointState gained later) is an error, never a silent default.
    partial = dict(values)
    del partial["timeslice_wait_ms"]
    with pytest.raises(TypeError, match="missing \\['timeslice_wait_ms'\\]"):
        trusted_state(**partial)
    with pytest.raises(TypeError, match="unknown \\['colour'\\]"):
        trusted_state(**values, colour="red")


def _published_states(decode_runs: bool) -> tuple[list[list[tuple[str, int, int, float]]], list[tuple[int, float]]]:
    """Every candidate's published running count, decoding tokens and KV use at each routing decision, and the
    completions, of 300 Mooncake requests on the mixed fleet without step jitter."""
    from leadtime.simulator.fleet import load_fleet
    from leadtime.simulator.workload import load_workload, shape

    fleet = dataclasses.replace(load_fleet("mixed"), step_jitter=0.0)
    workload = shape(load_workload("mooncake", 0, 300), rate_scale=1.0, max_requests=300)
    sim = FleetSimulator(fleet, workload, make_policy("llmd_heuristic", 0, fleet), seed=0)
    for e in sim.endpoints:
        e.decode_runs = decode_runs
    seen: list[list[tuple[str, int, int, float]]] = []
    route = sim._route

    def recording(request: SimRequest) -> None:
        states = [c.state for c in sim.candidates(request)]
        seen.append(
            [(s.endpoint_id, s.num_request_running, s.decode_tokens_in_flight, s.kv_cache_percentage) for s in states]
        )
        route(request)

    sim._route = recording  # type: ignore[method-assign]
    result = sim.run()
    return seen, [(c.rid, round(c.e2e_ms, 6)) for c in result.completed]


def test_routers_see_a_decode_run_as_they_would_see_its_steps() -> None:
    """Regression: a decode run (many decode steps in one event) published the tokens decoding as they stood when
    it began, and KV use with every block of the run taken at its start: routers saw up to 31% fewer tokens
    decoding, and more KV in use, than step-by-step decoding showed at the same instant."""
    by_step, completions_by_step = _published_states(decode_runs=False)
    by_run, completions_by_run = _published_states(decode_runs=True)
    assert completions_by_run == completions_by_step  # the same requests, served the same
    assert len(by_run) == len(by_step)
    for step_states, run_states in zip(by_step, by_run, strict=True):
        for (eid, running, decoding, kv), (eid_run, running_run, decoding_run, kv_run) in zip(
            step_states, run_states, strict=True
        ):
            assert (eid_run, running_run, decoding_run) == (eid, running, decoding)
            assert kv_run == pytest.approx(kv, abs=1e-9)


def test_a_group_back_before_its_last_step_ends_serves_on() -> None:
    """Regression: a time-slice group resumed while the step in flight at its swap-out still ran (away and restore
    shorter than that step) stayed parked when the step ended, and sat out its whole next resident window while it
    was shown to routers as resident."""
    fleet = parse_fleet(
        {
            "pools": [
                {
                    "name": "ts",
                    "count": 1,
                    "accelerator": "l40s",
                    "model": "llama-3.1-8b",
                    "timeslice_group": "g",
                    "max_num_batched_tokens": 8192,
                }
            ],
            "timeslice_groups": {
                "g": {"resident_ms": {"value": 100}, "away_ms": {"value": 5}, "restore_ms": {"value": 5}}
            },
        }
    )
    # An 8,000-token prompt at 60 ms: its prefill step is in flight when the group is handed away at 100 ms.
    workload = [WorkloadRequest(60.0, 8000, 50), WorkloadRequest(61.0, 100, 2)]
    sim = FleetSimulator(fleet, workload, make_policy("round_robin", 0, fleet), seed=0)
    (endpoint,) = sim.endpoints
    shown_resident_but_idle: list[float] = []
    on_step = sim._on_step

    def after_step(e: Endpoint) -> None:
        on_step(e)
        if sim.groups["g"].state == "resident" and not endpoint.available:
            shown_resident_but_idle.append(sim.now)

    sim._on_step = after_step  # type: ignore[method-assign,assignment]
    sim.run()
    assert shown_resident_but_idle == []


def test_a_request_of_segments_of_0_tokens_is_refused_with_or_without_segments() -> None:
    """`segment_tokens=0` was refused only on a request with prefix segments: on one without, the first prefill step
    divided by it (ZeroDivisionError; found by tests/test_sim_properties.py)."""
    workload = [WorkloadRequest(0.0, 300, 5, (), 0)]
    with pytest.raises(SimulationError, match="request 0: .*segment_tokens"):
        FleetSimulator(parse_fleet(_fleet()), workload, make_policy("round_robin"))
