"""llm-d's predicted-latency router as re-implemented: counters, affinity gates, headroom, P/D order, learning."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from leadtime.features.rows import EndpointState
from leadtime.router_plugin.peers.llmd_predicted import LlmdPredictedPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.run import make_policy
from leadtime.simulator.workload import SyntheticSpec, synthetic


@dataclass
class Answers:
    ttft_mean: np.ndarray
    ttft_quantile: np.ndarray
    tpot_mean: np.ndarray
    tpot_quantile: np.ndarray


class Model:
    """llm-d's model protocol: TTFT from waiting and in-flight prefill tokens, TPOT from running requests."""

    def __init__(self) -> None:
        self.asked: list[list[dict[str, Any]]] = []
        self.learned: list[Mapping[str, Any]] = []
        self.retrains = 0

    def predict_many(self, rows: Sequence[Mapping[str, Any]]) -> Answers:
        self.asked.append([dict(r) for r in rows])
        ttft = np.array([100.0 + 300.0 * r["num_request_waiting"] + 0.1 * r["prefill_tokens_in_flight"] for r in rows])
        tpot = np.array([10.0 + 5.0 * r["num_request_running"] for r in rows])
        return Answers(ttft, 1.1 * ttft, tpot, 1.1 * tpot)

    def learn_many(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.learned.extend(rows)

    def retrain(self) -> None:
        self.retrains += 1


def cand(name: str, waiting: int = 0, running: int = 0, hits: int = 0, role: str = "both") -> Candidate:
    return Candidate(
        EndpointState(endpoint_id=name, role=role, num_request_waiting=waiting, num_request_running=running), hits
    )


def req(rid: str, tokens: int = 1000, ttft_slo: float | None = 2000.0, tpot_slo: float | None = 50.0) -> RouteRequest:
    return RouteRequest(rid, tokens, (), ttft_slo, tpot_slo)


def test_uncached_prompt_tokens_are_prefill_until_the_first_token_then_the_prompt_is_decode() -> None:
    """llm-d's accounting (as `router_plugin.gateway.inflight_work` keeps it too): a request's uncached prompt
    tokens count as prefill work until its first token, then its prompt and generated tokens as decode work until
    it completes. The two counters were the same number on a unified fleet, moving together."""
    model = Model()
    policy = LlmdPredictedPolicy(model)
    first = policy.pick(req("r1", 4000), [cand("a", hits=1000), cand("b", waiting=1)])
    assert first.endpoint_id == "a"
    policy.pick(req("r2", 1000), [cand("a", hits=1000), cand("b", waiting=1)])
    assert model.asked[-1][0]["prefill_tokens_in_flight"] == 3000  # r1's 3,000 uncached tokens (scrape: nothing)
    assert model.asked[-1][0]["decode_tokens_in_flight"] == 0
    policy.prefilled("r1", 200.0)
    policy.pick(req("r3"), [cand("a"), cand("b", waiting=5)])
    assert model.asked[-1][0]["decode_tokens_in_flight"] == 4000 + 1  # its prompt and its first token
    assert model.asked[-1][0]["prefill_tokens_in_flight"] in (0, 1000)  # r2 may be on a, still prefilling
    policy.observe(Outcome("r1", "a", None, 300.0, 12.0, 20, 500.0))
    policy.pick(req("r4"), [cand("a"), cand("b", waiting=5)])
    assert model.asked[-1][0]["decode_tokens_in_flight"] == 0


def test_on_pd_the_prefill_endpoint_counts_until_the_first_token_and_the_decode_endpoint_from_then() -> None:
    model = Model()
    policy = LlmdPredictedPolicy(model)
    cands = [cand("p1", role="prefill", hits=500), cand("d1", role="decode")]
    pick = policy.pick(req("r1", 3000), cands)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p1", "d1")
    policy.pick(req("r2", 1000), cands)
    (d_row,), (p_row,) = model.asked[-2], model.asked[-1]  # the decode side is asked first
    assert (d_row["pod_type"], d_row["decode_tokens_in_flight"]) == ("decode", 0)  # r1 is not decoding yet
    assert (p_row["pod_type"], p_row["prefill_tokens_in_flight"]) == ("prefill", 2500)  # r1's uncached tokens
    policy.prefilled("r1", 400.0)
    policy.pick(req("r3", 1000), cands)
    (d_row,), (p_row,) = model.asked[-2], model.asked[-1]
    assert d_row["decode_tokens_in_flight"] == 3000 + 1
    assert p_row["prefill_tokens_in_flight"] == 500  # r2's uncached tokens; r1's prefill is done


@pytest.mark.parametrize("first_token", [False, True], ids=["prefilling", "decoding"])
def test_an_abandoned_request_leaves_the_counters_and_teaches_nothing(first_token: bool) -> None:
    """A failed request stayed in flight for ever; llm-d's response-complete hook runs for it as for any."""
    model = Model()
    policy = LlmdPredictedPolicy(model)
    policy.pick(req("r1", 2000), [cand("a")])
    if first_token:
        policy.prefilled("r1", 100.0)
    policy.abandon("r1")
    policy.pick(req("r2"), [cand("a")])
    assert (model.asked[-1][0]["prefill_tokens_in_flight"], model.asked[-1][0]["decode_tokens_in_flight"]) == (0, 0)
    policy.observe(Outcome("r1", "a", None, 300.0, 12.0, 20, 500.0))  # a late outcome of it: nothing to learn
    assert model.learned == []


def test_the_prefix_affinity_gates_come_before_headroom() -> None:
    policy = LlmdPredictedPolicy(Model())
    # c holds 99% of the prompt: only it is considered although b has more headroom.
    assert policy.pick(req("r1"), [cand("a", waiting=3), cand("b"), cand("c", waiting=2, hits=990)]).endpoint_id == "c"
    # No endpoint at 99%: those at ≥ 80% only.
    assert policy.pick(req("r2"), [cand("a", hits=700), cand("b", waiting=1, hits=850)]).endpoint_id == "b"


def test_positive_headroom_is_preferred_and_weighted_towards_ttft() -> None:
    policy = LlmdPredictedPolicy(Model())
    # a: TTFT 100 ms (headroom 0.95), TPOT 60 ms > 50 (negative); b: TTFT 700, TPOT 20: positive on both.
    assert policy.pick(req("r1"), [cand("a", running=10), cand("b", waiting=2, running=2)]).endpoint_id == "b"
    # Both positive (a fresh router: nothing in flight): 0.8 of the combined headroom is TTFT's, so a's shorter
    # TTFT (headroom 0.95 against 0.78) outweighs b's better TPOT (0.78 against 0.34).
    fresh = LlmdPredictedPolicy(Model())
    assert fresh.pick(req("r2"), [cand("a", running=4), cand("b", waiting=1, running=0)]).endpoint_id == "a"


@pytest.mark.parametrize("slos", [(math.inf, math.inf), (math.inf, None), (None, math.inf)])
def test_an_infinite_slo_routes_as_none(slos: tuple[float | None, float | None]) -> None:
    """Regression: (inf − predicted) / inf was NaN on every candidate, and the pick raised IndexError."""
    candidates = [cand("a", waiting=2), cand("b"), cand("c", running=3)]
    pick = LlmdPredictedPolicy(Model()).pick(req("r1", ttft_slo=slos[0], tpot_slo=slos[1]), candidates)
    assert pick.endpoint_id == "b"  # the lowest predicted latency, as without SLOs


def test_pd_picks_decode_first_then_prefill_and_disaggregates_above_the_threshold() -> None:
    model = Model()
    policy = LlmdPredictedPolicy(model)
    cands = [
        cand("p0", waiting=2, role="prefill"),
        cand("p1", role="prefill"),
        cand("d0", running=8, role="decode"),
        cand("d1", running=1, role="decode"),
    ]
    pick = policy.pick(req("r1"), cands)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p1", "d1")
    assert [r["pod_type"] for r in model.asked[0]] == ["decode", "decode"]  # decode side asked first
    short = policy.pick(req("r2", tokens=10), cands)
    assert short.decode_endpoint_id is None and short.endpoint_id.startswith("d")  # 10 < 16 tokens: not split


def test_each_outcome_becomes_a_ttft_row_and_a_tpot_row_and_the_timer_retrains() -> None:
    model = Model()
    policy = LlmdPredictedPolicy(model, retrain_every_ms=10_000.0)
    policy.pick(req("r1"), [cand("a", waiting=1)])
    policy.observe(Outcome("r1", "a", None, 420.0, 14.0, 30, 10_500.0))
    ttft_row, tpot_row = model.learned
    assert ttft_row["actual_ttft_ms"] == 420.0 and ttft_row["actual_tpot_ms"] == 0.0
    assert ttft_row["num_tokens_generated"] == 0 and ttft_row["num_request_waiting"] == 1
    assert tpot_row["actual_tpot_ms"] == 14.0 and tpot_row["actual_ttft_ms"] == 0.0
    assert model.retrains == 1
    policy.pick(req("r2"), [cand("a")])
    policy.observe(Outcome("r2", "a", None, 300.0, 0.0, 1, 12_000.0))
    assert len(model.learned) == 3 and model.retrains == 1  # one token: no TPOT row; 1.5 s: no retrain yet


def test_it_routes_a_tiny_fleet_with_llm_ds_real_predictor() -> None:
    fleet = parse_fleet({"pools": [{"name": "h", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]})
    workload = synthetic(SyntheticSpec(requests=80, rate_rps=10, input_mean=800), seed=3)
    result = FleetSimulator(
        fleet, workload, make_policy("llmd_predicted", 0, fleet), ttft_slo_ms=2000, tpot_slo_ms=100
    ).run()
    assert result.policy == "llmd_predicted" and len(result.completed) == 80
    assert all(o.predicted_ttft_ms is not None for o in result.observations)


def test_following_another_routers_picks_counts_and_learns_them_as_its_own() -> None:
    model = Model()
    policy = LlmdPredictedPolicy(model)
    pool = [cand("p1", role="prefill"), cand("p2", role="prefill"), cand("d1", running=4, role="decode")]
    # A pair another router chose: predicted and counted as if llm-d's router had sent it there.
    ttft, tpot = policy.follow(req("r1", 3000), pool, Pick("p2", "d1"))
    assert (ttft, tpot) == (100.0, 30.0)  # p2's TTFT row, d1's TPOT row
    assert [r["pod_type"] for r in model.asked[-1]] == ["prefill", "decode"]
    policy.follow(req("r2", 500), pool, Pick("p2", "d1"))
    assert model.asked[-1][0]["prefill_tokens_in_flight"] == 3000  # r1 counted on p2
    assert model.asked[-1][1]["decode_tokens_in_flight"] == 0  # and on d1 once its first token is back
    policy.prefilled("r1", 300.0)
    policy.prefilled("r2", 310.0)
    # Prefilled on the decode endpoint itself: one row, as llm-d's own local path records it.
    policy.follow(req("r3", 8), pool, Pick("d1"))
    assert model.asked[-1][0]["pod_type"] == "decode"
    assert model.asked[-1][1]["decode_tokens_in_flight"] == 3001 + 501
    policy.prefilled("r3", 320.0)
    policy.observe(Outcome("r1", "p2", "d1", 400.0, 25.0, 10, 900.0))
    assert [(r["actual_ttft_ms"], r["actual_tpot_ms"]) for r in model.learned] == [(400.0, 0.0), (0.0, 25.0)]
    assert model.learned[0]["pod_type"] == "prefill" and model.learned[1]["pod_type"] == "decode"
    policy.follow(req("r4", 100), pool, Pick("p1", "d1"))
    assert model.asked[-1][0]["prefill_tokens_in_flight"] == 0  # p1 never had anything
    assert model.asked[-1][1]["decode_tokens_in_flight"] == 501 + 9  # r1 done; r2 and r3 still decode on d1
