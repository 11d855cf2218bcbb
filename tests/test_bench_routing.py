"""`leadtime bench routing`: a smoke run of the benchmark, and its target checks on hand-made figures."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_router_hold import HoldsOnce

from leadtime.bench.routing import (
    LOAD_TARGET,
    Cell,
    RoutingOptions,
    _mean_metrics,
    cell_metrics,
    check_targets,
    check_trace,
    policies_for,
    print_report,
    report_loads,
    run_cell,
    run_routing,
    selected_policies,
    write_plots,
)
from leadtime.bench.shadow import FollowedByLlmd
from leadtime.features.rows import EndpointState
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.peers.llmd_predicted import LlmdPredictedPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.router_plugin.predicted import LeadtimePolicy
from leadtime.simulator.engine import CompletedRequest, FailedRequest, FleetSimulator, SimResult
from leadtime.simulator.fleet import load_fleet, parse_fleet
from leadtime.simulator.learning_policies import leadtime_policy
from leadtime.simulator.workload import WorkloadRequest


@pytest.fixture(scope="module")
def small_run() -> tuple[dict[str, Any], dict[tuple[str, str, str], Any]]:
    options = RoutingOptions(
        max_requests=150,
        fleets=("mixed",),
        policies=("round_robin", "llmd_heuristic", "clairvoyant", "leadtime", "leadtime_no_hardware"),
        workers=1,
    )
    return run_routing(options)


def test_the_report_has_every_figure_the_issue_names(
    small_run: tuple[dict[str, Any], dict[tuple[str, str, str], Any]],
) -> None:
    report, curves = small_run
    mixed = report["fleets"]["mixed"]
    windows_s: dict[str, list[float]] = {}
    assert mixed["capacity_rps"] > 0
    assert mixed["high"]["rate_rps"] == pytest.approx(1.5 * mixed["base"]["rate_rps"])
    for load in ("base", "high"):
        policies = mixed[load]["policies"]
        assert set(policies) == {"round_robin", "llmd_heuristic", "clairvoyant", "leadtime", "leadtime_no_hardware"}
        for name, m in policies.items():
            assert 0 <= m["slo_attainment"] <= 1
            # Requests that met their SLOs per second of the arrival window, the same window for every policy.
            met = m["slo_attainment"] * (len(curves[("mixed", load, name)]["ttft_ms"]) + m["failed"])
            assert m["goodput_rps"] > 0 and met > 0
            windows_s.setdefault(load, []).append(met / m["goodput_rps"])
            assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p99"]
            assert 0 < m["itl_ms"]["p50"] <= m["itl_ms"]["p99"]
            assert m["decision_ms"]["p50"] <= m["decision_ms"]["p99"]
            assert ("prediction_mape" in m) == name.startswith("leadtime")
        first = windows_s[load][0]
        assert windows_s[load] == pytest.approx([first] * len(policies), rel=1e-3), windows_s[load]
        mape = policies["leadtime"]["prediction_mape"]
        assert 0 < mape["ttft"] < 10 and 0 < mape["tpot"] < 10
        ceiling = mixed[load]["ceiling_rps"]  # what no router passes
        assert max(m["goodput_rps"] for m in policies.values()) <= ceiling <= 1.01 * mixed[load]["rate_rps"]
    targets = report["targets"]
    assert targets["mixed/high"]["best_peer"] in ("round_robin", "llmd_heuristic")
    assert "L_ge_1.10B" in targets["mixed/high"]
    assert targets["mixed/base"]["ceiling_over_B"] == pytest.approx(
        mixed["base"]["ceiling_rps"] / targets["mixed/base"]["B"]
    )
    assert set(targets["ablations"]) == {"leadtime_no_hardware"}
    json.dumps(report)  # plain JSON all the way down


def test_plots_are_written(small_run: tuple[dict[str, Any], dict[tuple[str, str, str], Any]], tmp_path: Path) -> None:
    report, curves = small_run
    files = write_plots(report, curves, tmp_path)
    assert {p.name for p in files} == {"goodput.png", "latency_cdf_mixed.png"}
    assert all(p.stat().st_size > 10_000 for p in files)


def test_the_demo_shows_each_policys_itl_beside_its_goodput(
    small_run: tuple[dict[str, Any], dict[tuple[str, str, str], Any]],
) -> None:
    """Its table gave goodput and TTFT only: Leadtime's longer ITL tail on P/D (p99 174 against 19-23 ms) was in
    report.json alone."""
    from rich.console import Console

    from leadtime.bench.routing_demo import itl_table

    report, _ = small_run
    demo_like = {
        "fleets": {fleet: {"high": report["fleets"]["mixed"]["high"]} for fleet in ("mixed", "pd", "timesliced")}
    }
    console = Console(record=True, width=160)
    console.print(itl_table(demo_like, ("round_robin", "leadtime")))
    text = console.export_text()
    leadtime = report["fleets"]["mixed"]["high"]["policies"]["leadtime"]["itl_ms"]
    assert "ITL p50 / p99 (ms), high load" in text
    assert f"{leadtime['p50']:.0f} / {leadtime['p99']:.0f}" in text


def _cell(goodput: float, p50: float = 100.0, p99: float = 1000.0) -> dict[str, Any]:
    return {"goodput_rps": goodput, "ttft_ms": {"p50": p50, "p99": p99}, "decision_ms": {"p99": 0.5}}


def test_target_rules_on_hand_made_figures() -> None:
    policies = {
        "round_robin": _cell(1.0),
        "dynamo_kv": _cell(2.0, 90.0, 900.0),
        "clairvoyant": _cell(3.0),
        "leadtime": _cell(2.9, 80.0, 950.0),
        "leadtime_no_inflight": _cell(2.0),
    }
    report = {"fleets": {"mixed": {"high": {"rate_rps": 1.0, "ceiling_rps": 3.2, "policies": policies}}}}
    entry = check_targets(report)["mixed/high"]
    assert entry["ceiling_over_B"] == pytest.approx(1.6) and entry["L_over_ceiling"] == pytest.approx(2.9 / 3.2)
    assert entry["best_peer"] == "dynamo_kv" and entry["B"] == 2.0
    assert entry["gap_closed"] == pytest.approx(0.9) and entry["gap_closed_ge_0.8"]
    assert entry["L_ge_1.10B"]
    assert not entry["ttft_no_worse"]  # p99 950 against the best peer's 900
    ablation = check_targets(report)["ablations"]["leadtime_no_inflight"]
    assert ablation["loss_at_high_load"]["mixed"] == pytest.approx(1 - 2.0 / 2.9)
    assert ablation["loses_ge_3pct"]


def test_where_the_clairvoyant_is_no_better_the_rule_is_within_3_percent_of_it() -> None:
    policies = {"least_queue": _cell(2.0), "clairvoyant": _cell(2.05), "leadtime": _cell(2.0)}
    entry = check_targets({"fleets": {"homogeneous": {"base": {"rate_rps": 1, "policies": policies}}}})
    assert "gap_closed" not in entry["homogeneous/base"]
    assert entry["homogeneous/base"]["L_ge_0.97C"]


def test_ablations_run_only_where_their_feature_acts() -> None:
    assert "leadtime_decode_first" in policies_for("pd") and "leadtime_decode_first" not in policies_for("mixed")
    assert "leadtime_no_timeslice" in policies_for("timesliced")
    assert "leadtime_no_inflight" in policies_for("homogeneous")
    assert "leadtime_no_decode_harm" in policies_for("large") and "leadtime_no_decode_harm" not in policies_for("pd")


def test_a_variant_runs_only_when_asked_for() -> None:
    assert "leadtime_in_turn" not in policies_for("homogeneous")
    assert policies_for("homogeneous", ["leadtime", "leadtime_in_turn"]) == ["leadtime", "leadtime_in_turn"]
    assert selected_policies(["leadtime-in-turn"], ["mixed"]) == ("leadtime_in_turn",)
    assert selected_policies(["leadtime-hold"], ["large"]) == ("leadtime_hold",)
    # Naming the time-sliced endpoints as overflow acts only where there are some.
    assert policies_for("timesliced", ["leadtime_overflow_timesliced"]) == ["leadtime_overflow_timesliced"]
    assert policies_for("mixed", ["leadtime_overflow_timesliced"]) == []


def test_the_overflow_variant_names_the_fleets_time_sliced_endpoints() -> None:
    fleet = load_fleet("timesliced")
    policy = leadtime_policy("leadtime_overflow_timesliced", fleet)
    assert isinstance(policy, LeadtimePolicy)
    assert policy.config.overflow_endpoints == ("shared-0", "shared-1", "shared-2", "shared-3")
    plain = leadtime_policy("leadtime", fleet)
    assert isinstance(plain, LeadtimePolicy) and plain.config.overflow_endpoints == ()


def test_cli_refuses_an_unknown_fleet() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "leadtime", "bench", "routing", "--fleet", "nowhere"], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "nowhere" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "fastest"], "--policy 'fastest': not a benchmark policy"),
        (["--policy", "leadtime_decode_first", "--fleet", "mixed"], "runs only on pd, pd_hetero"),
        (["--load", "0"], "--load must be > 0"),
        (["--load", "nan"], "--load must be > 0"),
        (["--load", "1.5", "--load", "1.50"], "--load: each load once (high was given twice)"),
    ],
)
def test_cli_refuses_a_policy_that_would_run_nowhere(args: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "leadtime", "bench", "routing", *args], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


def test_loads_between_the_two_are_run_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = RoutingOptions(
        max_requests=120, fleets=("homogeneous",), policies=("least_queue", "leadtime"), workers=1, loads=(1.2,)
    )
    report, curves = run_routing(options)
    fleet = report["fleets"]["homogeneous"]
    assert report_loads(fleet) == ["1.2x"] and report["run"]["loads"] == {"1.2x": 1.2}
    assert report["run"]["requests"] == 120  # the count replayed, beside the option's max_requests
    assert any("less reliable" in w for w in report["run"]["warnings"])  # a capacity search on 120 requests
    assert fleet["1.2x"]["rate_rps"] == pytest.approx(1.2 * LOAD_TARGET * fleet["capacity_rps"])
    assert report["targets"]["homogeneous/1.2x"]["best_peer"] == "least_queue"
    assert {p.name for p in write_plots(report, curves, tmp_path)} == {"goodput.png", "latency_cdf_homogeneous.png"}
    print_report(report, as_json=False)
    out = capsys.readouterr().out
    assert "1.2x" in out
    # The targets are a table, where they were a page of raw JSON after the tables.
    assert "targets (B: best peer" in out and "homogeneous/1.2x" in out and '"L_ge_B"' not in out


def test_without_a_peer_the_targets_are_one_line_not_an_empty_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: `--policy leadtime` alone printed the targets' table with its headers and no row."""
    options = RoutingOptions(max_requests=120, fleets=("homogeneous",), policies=("leadtime",), workers=1, loads=(1.2,))
    report, _ = run_routing(options)
    assert [k for k in report["targets"] if k != "ablations"] == []
    print_report(report, as_json=False)
    out = capsys.readouterr().out
    assert "targets (B: best peer" not in out and "fleet/load" not in out
    assert "targets: none checked: they compare leadtime with the best peer (run one of" in " ".join(out.split())


def test_a_load_given_twice_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="1.2x was given twice"):
        run_routing(RoutingOptions(fleets=("homogeneous",), loads=(1.2, 1.2000000001)))


def test_policies_may_be_spelled_with_hyphens() -> None:
    assert selected_policies(["leadtime-no-inflight", "round_robin"], ["mixed"]) == (
        "leadtime_no_inflight",
        "round_robin",
    )


def test_llm_ds_predictor_follows_leadtimes_picks_without_changing_one() -> None:
    plain = Cell("pd", "base", 4.0, "leadtime", 0, "mooncake", 200)
    _, alone, curves = run_cell(plain)
    _, followed, followed_curves = run_cell(replace(plain, follow_llmd=True))
    assert followed_curves["ttft_ms"] == curves["ttft_ms"] and followed_curves["itl_ms"] == curves["itl_ms"]
    assert followed["prediction_mape"] == alone["prediction_mape"]
    assert "llmd_mape_on_same_requests" not in alone
    mape = followed["llmd_mape_on_same_requests"]
    assert 0 < mape["ttft"] < 100 and 0 < mape["tpot"] < 100


class _Model:
    """llm-d's model protocol with fixed answers, counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def predict_many(self, rows: Any) -> Any:
        self.calls += 1
        n = len(rows)
        return SimpleNamespace(ttft_mean=np.full(n, 500.0), ttft_quantile=np.full(n, 600.0), tpot_mean=np.full(n, 20.0))

    def learn_many(self, rows: Any) -> None:
        pass

    def retrain(self) -> None:
        pass


def test_the_follower_predicts_after_the_pick_so_its_work_is_not_the_decisions() -> None:
    model = _Model()
    follower = LlmdPredictedPolicy(model)
    followed = FollowedByLlmd(RoundRobinPolicy(), follower)
    candidates = [Candidate(EndpointState(endpoint_id="a")), Candidate(EndpointState(endpoint_id="b"))]
    pick = followed.pick(RouteRequest("r1", 1000, (), 2000.0, 100.0), candidates)
    assert model.calls == 0  # nothing of the follower's inside the timed pick
    followed.observe(Outcome("r1", pick.endpoint_id, None, 450.0, 25.0, 10, 900.0))
    assert model.calls == 1
    assert followed.ttft_pairs == [(450.0, 500.0)] and followed.tpot_pairs == [(25.0, 20.0)]


def test_a_held_request_is_followed_where_it_is_placed() -> None:
    model = _Model()
    followed = FollowedByLlmd(HoldsOnce(), LlmdPredictedPolicy(model))
    candidates = [Candidate(EndpointState(endpoint_id="a")), Candidate(EndpointState(endpoint_id="b"))]
    assert followed.pick(RouteRequest("r1", 1000, (), 2000.0, 100.0), candidates).hold
    pick = followed.pick(RouteRequest("r1", 1000, (), 2000.0, 100.0, 50.0, held_ms=50.0), candidates)
    followed.observe(Outcome("r1", pick.endpoint_id, None, 450.0, 25.0, 10, 900.0))
    assert model.calls == 1 and followed.ttft_pairs == [(450.0, 500.0)]


class _Rows(_Model):
    """`_Model`, keeping the rows it was asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []

    def predict_many(self, rows: Any) -> Any:
        self.rows.extend(rows)
        return super().predict_many(rows)


class _AllToA(RoundRobinPolicy):
    """Every request to endpoint a; keeps the hooks it is told of."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, str]] = []

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        return Pick("a")

    def prefilled(self, request_id: str, now_ms: float) -> None:
        self.told.append(("prefilled", request_id))

    def abandon(self, request_id: str) -> None:
        self.told.append(("abandon", request_id))


def test_first_tokens_and_failures_reach_the_followed_policy_and_the_follower() -> None:
    """Wrapped, the policy was never told of a failed request (Leadtime's ledgers kept it), and llm-d's follower
    counted every request as prefill work until it completed, whatever its first token."""
    model = _Rows()
    policy = _AllToA()
    followed = FollowedByLlmd(policy, LlmdPredictedPolicy(model))
    candidates = [Candidate(EndpointState(endpoint_id="a")), Candidate(EndpointState(endpoint_id="b"))]
    followed.pick(RouteRequest("r1", 1000, (), 2000.0, 100.0), candidates)
    followed.prefilled("r1", 10.0)  # r1 decodes on a
    followed.pick(RouteRequest("r2", 500, (), 2000.0, 100.0), candidates)
    followed.abandon("r1")
    followed.pick(RouteRequest("r3", 200, (), 2000.0, 100.0), candidates)
    followed.observe(Outcome("r2", "a", None, 450.0, 25.0, 10, 900.0))
    assert policy.told == [("prefilled", "r1"), ("abandon", "r1")]
    in_flight = [
        (r["input_token_length"], r["prefill_tokens_in_flight"], r["decode_tokens_in_flight"]) for r in model.rows
    ]
    assert in_flight == [(1000, 0, 0), (500, 0, 1001), (200, 500, 0)]  # r3 sees r2 prefilling and r1 gone


def test_two_workers_report_what_one_does() -> None:
    """Capacity searches and cells both go to the workers; the figures cannot depend on where they ran."""
    options = RoutingOptions(max_requests=120, fleets=("homogeneous",), policies=("round_robin", "least_queue"))
    alone, _ = run_routing(replace(options, workers=1))
    pooled, _ = run_routing(replace(options, workers=2))

    def outcomes(report: dict[str, Any]) -> dict[str, Any]:  # all but the decision times, which are measured
        fleet = report["fleets"]["homogeneous"]
        return {
            "capacity": fleet["capacity_rps"],
            **{
                f"{load}/{name}": {k: v for k, v in m.items() if not k.startswith("decision")}
                for load in ("base", "high")
                for name, m in fleet[load]["policies"].items()
            },
        }

    assert outcomes(pooled) == outcomes(alone)


def test_the_demo_plots_prediction_error_in_percent_of_the_actual() -> None:
    """The curve was a fraction (3.0 for 300%) under an axis labelled "%"."""
    from leadtime.bench.routing_demo import rolling_error_percent

    pairs = [(100.0, 150.0), (200.0, 100.0), (50.0, 50.0), (10.0, 40.0)]  # (actual, predicted): 50, 50, 0, 300 %
    x, y = rolling_error_percent(pairs, window=2)
    assert x.tolist() == [1, 2, 3]
    assert y.tolist() == pytest.approx([50.0, 25.0, 150.0])


def _mooncake(path: Path, count: int) -> Path:
    rows = [{"timestamp": 1000 * i, "input_length": 300, "output_length": 5} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_trace_shorter_than_the_least_max_requests_is_refused_saying_its_count(tmp_path: Path) -> None:
    """With --max-requests 100 a 20-request trace ran, reported as "max_requests": 100."""
    trace = _mooncake(tmp_path / "short.jsonl", 20)
    with pytest.raises(ValueError, match=r"short\.jsonl: 20 requests; .* at least 100"):
        check_trace(RoutingOptions(trace=str(trace), max_requests=100))


def test_a_short_trace_is_run_with_a_warning_and_a_long_one_without() -> None:
    count, warnings = check_trace(RoutingOptions(max_requests=300))
    assert count == 300 and len(warnings) == 1 and "300 requests" in warnings[0] and "less reliable" in warnings[0]
    assert check_trace(RoutingOptions(max_requests=3000)) == (3000, [])


def test_the_capacity_searches_are_told_to_the_progress_bar() -> None:
    """A short run spent a good share of its time in them with a bar reading "0/?"."""
    told: list[tuple[int, int, str]] = []
    options = RoutingOptions(max_requests=100, fleets=("homogeneous",), policies=("round_robin",), workers=1)
    run_routing(options, progress=lambda done, total, what: told.append((done, total, what)))
    assert told[0] == (1, 1, "capacity of homogeneous (seed 0)")
    assert told[-1][:2] == (2, 2) and told[-1][2].startswith("homogeneous high")  # then the runs, base and high


def _done(rid: int, arrival_ms: float, ttft_ms: float = 200.0) -> CompletedRequest:
    """A request that met its SLOs (TTFT 1 s, ITL 50 ms)."""
    return CompletedRequest(rid, arrival_ms, 100, 10, ttft_ms, 20.0, 400.0, "e0", None, 0, 0, 0.0, 1000.0, 50.0)


def _result(done: list[CompletedRequest], **fields: Any) -> SimResult:
    span = max(c.arrival_ms for c in done) - min(c.arrival_ms for c in done)
    return SimResult("x", done, [], {"e0": []}, {"e0": {}}, {}, span + 1000.0, 0, arrival_span_ms=span, **fields)


def test_a_request_the_fleet_could_not_serve_is_a_missed_slo_and_counted() -> None:
    """Attainment was met / completed, so a cell dropping requests read as attaining more than one serving them
    late, and the JSON never said any had failed; `leadtime simulate` (report.summarize) counts them as misses."""
    from leadtime.simulator.report import summarize

    result = _result(
        [_done(i, i * 1000.0, ttft_ms=100.0 * (i + 1)) for i in range(9)],
        failed=[FailedRequest(9, 9000.0, 10**6, "too large", "kv_cache")],
    )
    metrics = cell_metrics(result, False)
    assert metrics["slo_attainment"] == pytest.approx(0.9) == summarize(result)["slo_attainment"]
    assert metrics["failed"] == 1
    assert metrics["ttft_ms"]["p50"] == 500.0  # over the nine completed: a failed request has no latency


def test_failures_are_averaged_over_seeds_with_their_range() -> None:
    dropped = [FailedRequest(rid, 500.0, 10**6, "too large", "kv_cache") for rid in (2, 3)]
    runs = [cell_metrics(_result([_done(0, 0.0), _done(1, 1000.0)], failed=f), False) for f in ([], dropped)]
    mean = _mean_metrics(runs)
    assert mean["failed"] == 1.0 and mean["failed_range"] == [0.0, 2.0]


def _scaled_out(join_at_s: float) -> SimResult:
    """Round-robin on two H100s joined by an H200 at `join_at_s`; 20 requests, one each 100 ms from 0 to 1.9 s."""
    fleet = parse_fleet(
        {
            "pools": [
                {"name": "old", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
                {"name": "new", "count": 1, "accelerator": "h200-sxm", "model": "llama-3.1-8b", "join_at_s": join_at_s},
            ]
        }
    )
    workload = [WorkloadRequest(i * 100.0, 300, 5) for i in range(20)]
    return FleetSimulator(fleet, workload, RoundRobinPolicy(), ttft_slo_ms=2000.0, tpot_slo_ms=100.0).run()


def test_goodput_after_the_join_is_per_second_of_the_arrivals_it_covers() -> None:
    """It was divided by 120 s whatever the run: on `large` the arrivals end 59-91 s after the H200s join, so the
    figure read 1.4-2x too low beside goodput_rps, which is per second of the arrival window."""
    result = _scaled_out(1.0)  # the last arrival 0.9 s after the join
    met = sum(c.meets_slo for c in result.completed if c.arrival_ms >= 1000.0)
    assert met == 10
    metrics = cell_metrics(result, False)
    assert metrics["after_join_goodput_rps"] == pytest.approx(met / 0.9)
    assert metrics["after_join_window_s"] == pytest.approx(0.9)
    assert "after_join_window_s" not in cell_metrics(replace(result, join_ms=0.0), False)  # no scale-out


def test_goodput_after_the_join_stops_at_120_s_when_the_arrivals_go_on() -> None:
    done = [_done(i, i * 10_000.0) for i in range(21)]  # one each 10 s to 200 s; the join at 50 s
    metrics = cell_metrics(_result(done, join_ms=50_000.0), False)
    assert metrics["after_join_window_s"] == 120.0
    assert metrics["after_join_goodput_rps"] == pytest.approx(12 / 120)  # the arrivals at 50, 60, ... 160 s


def test_a_join_after_the_last_arrival_has_no_goodput_after_it() -> None:
    """No request arrives after it: no rate to report (it read 0 req/s, as if every request then had failed)."""
    metrics = cell_metrics(_scaled_out(100.0), False)
    assert metrics["after_join_goodput_rps"] is None and metrics["after_join_window_s"] == 0.0


def test_decision_times_after_the_join_are_reported_apart() -> None:
    """On `large` the decision_ms percentiles mixed the decisions on 32 endpoints, before the H200s join, with
    those on the 40 the target is stated for."""
    costs = [0.1] * 60 + [1.0] * 40  # ms: 60 decisions before the join at 60 s, 40 after (on more endpoints)
    result = _result(
        [_done(i, i * 1000.0) for i in range(100)],
        join_ms=60_000.0,
        decision_ms=costs,
        decision_wall_ms=costs,
        decision_at_ms=[i * 1000.0 for i in range(100)],
    )
    metrics = cell_metrics(result, False)
    assert metrics["decision_ms_after_join"] == {"p50": 1.0, "p99": 1.0}
    assert metrics["decision_ms"]["p50"] == pytest.approx(0.1)  # every decision, as before
    assert "decision_ms_after_join" not in cell_metrics(replace(result, join_ms=0.0), False)
