"""The Leadtime routing plugin: scorer math, in-flight accounting, P/D pairs, time-slicing, learning, fallback."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from leadtime.features.rows import MAX_COUNT, MAX_PREDICTED_MS, EndpointState, FeatureRow, Observation
from leadtime.predictor.client import BulkPredictions, PredictorError, PredictorUnavailable
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.router_plugin.client import InProcessPredictor, PredictorClient
from leadtime.router_plugin.decoding import DecodingLedger, decode_harm
from leadtime.router_plugin.inflight import InflightLedger, Sent
from leadtime.router_plugin.pairs import PairPredictions, choose_pair
from leadtime.router_plugin.policy import Candidate, Outcome, RouteRequest, RoutingPolicy
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy
from leadtime.router_plugin.scorers.latency import (
    FEASIBLE,
    comfortable_scores,
    headroom,
    latency_scores,
    shared_step_scores,
    slo_scores,
)
from leadtime.router_plugin.timeslice import GroupStatus, ResidencyTracker


class QueueModel:
    """A predictor of our own protocol whose answers follow the rows' load: TTFT grows with the queue and
    the uncached prompt, ITL with the running batch. It records what it was asked and told."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.asked: list[list[FeatureRow]] = []
        self.told: list[Observation] = []

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        if self.fail:
            raise PredictorUnavailable("timeout", "deadline exceeded")
        self.asked.append(list(rows))
        ttft = np.array(
            [
                20.0
                + 200.0 * r.endpoint.num_request_waiting
                + 0.05 * r.request.uncached_tokens
                + r.endpoint.timeslice_wait_ms
                for r in rows
            ]
        )
        itl = np.array([10.0 + 2.0 * r.endpoint.num_request_running for r in rows])
        return BulkPredictions(ttft, 1.2 * ttft, itl, 1.2 * itl, 1, 0.9)

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        self.told.extend(observations)
        return len(observations)


def cand(
    name: str,
    waiting: int = 0,
    running: int = 0,
    hits: int = 0,
    role: str = "both",
    group: str = "",
    timeslice: str = "none",
    published_ms: float = 0.0,
) -> Candidate:
    state = EndpointState(
        endpoint_id=name,
        accelerator="h100-sxm",
        model="llama-3.1-8b",
        role=role,
        num_request_waiting=waiting,
        num_request_running=running,
        timeslice_state=timeslice,
    )
    return Candidate(state, hits, published_ms, group)


def req(
    rid: str = "r", tokens: int = 1000, at: float = 0.0, ttft_slo: float | None = 2000.0, itl_slo: float | None = 100.0
) -> RouteRequest:
    return RouteRequest(rid, tokens, (), ttft_slo, itl_slo, at)


# ------------------------------------------------------------------------------ scorer


def test_headroom_and_slo_scores() -> None:
    assert headroom(np.array([0.0, 2000.0, 4000.0]), 2000.0).tolist() == [1.0, 0.0, -1.0]
    ttft = np.array([100.0, 1900.0, 2100.0, 500.0])
    itl = np.array([10.0, 10.0, 10.0, 120.0])
    scores = slo_scores(ttft, itl, 2000.0, 100.0)
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert (scores >= FEASIBLE).tolist() == [True, True, False, False]  # feasible iff both predicted met
    assert scores[0] > scores[1]  # more slack, higher score
    assert scores[2] > scores[3]  # a 5% TTFT miss is better than a 20% ITL miss
    # Only one SLO: only that target counts.
    assert slo_scores(ttft, itl, 2000.0, None).tolist() == slo_scores(ttft, np.zeros(4), 2000.0, None).tolist()
    with pytest.raises(ValueError):
        slo_scores(ttft, itl, None, None)


def test_ties_on_the_binding_slo_are_broken_by_the_other() -> None:
    scores = slo_scores(np.array([1500.0, 500.0]), np.array([80.0, 80.0]), 2000.0, 100.0)
    assert scores[1] > scores[0] >= FEASIBLE


def test_among_candidates_that_meet_both_slos_slack_on_either_target_counts_alike() -> None:
    # a: first token at once (95% of the TTFT SLO left), ITL within 20% of its SLO; b: 30% left on both. Both
    # are predicted to meet; a leaves more slack in all (mean headroom 0.575 against 0.3) and wins, though its
    # binding target is tighter. Among predicted misses the binding target still rules (previous test).
    scores = slo_scores(np.array([100.0, 1400.0]), np.array([80.0, 70.0]), 2000.0, 100.0)
    assert scores.tolist() == pytest.approx([(1 + 0.575) / 2, (1 + 0.3) / 2])
    assert min(scores) >= FEASIBLE


def test_candidates_all_far_inside_both_slos_are_ranked_by_mean_ttft() -> None:
    p90_ttft, p90_itl = np.array([300.0, 900.0, 600.0]), np.array([45.0, 10.0, 30.0])
    mean_ttft = np.array([200.0, 800.0, 400.0])
    scores = comfortable_scores(p90_ttft, p90_itl, mean_ttft, 2000.0, 100.0, 0.5)
    assert scores is not None
    assert scores.tolist() == pytest.approx([1.0, 0.625, 0.75])  # the fastest 1, four times as slow 0.625
    assert min(scores) >= FEASIBLE  # all are predicted to meet the SLOs
    # One candidate past half of either SLO, a single candidate, one SLO missing or comfort 0: slack decides.
    assert comfortable_scores(np.array([300.0, 1100.0]), p90_itl[:2], mean_ttft[:2], 2000.0, 100.0, 0.5) is None
    assert comfortable_scores(p90_ttft[:2], np.array([45.0, 55.0]), mean_ttft[:2], 2000.0, 100.0, 0.5) is None
    assert comfortable_scores(p90_ttft[:1], p90_itl[:1], mean_ttft[:1], 2000.0, 100.0, 0.5) is None
    assert comfortable_scores(p90_ttft, p90_itl, mean_ttft, 2000.0, None, 0.5) is None
    assert comfortable_scores(p90_ttft, p90_itl, mean_ttft, 2000.0, 100.0, 0.0) is None


def test_latency_scores_without_slos() -> None:
    scores = latency_scores(np.array([100.0, 100.0, 300.0]), np.array([10.0, 20.0, 10.0]), 10.0)
    assert scores.tolist() == pytest.approx([1.0, 200 / 300, 200 / 400])


# ------------------------------------------------------------------------------ in-flight accounting


def test_ledger_counts_only_what_the_published_state_cannot_hold() -> None:
    ledger = InflightLedger()
    ledger.record_prefill("a", Sent("r1", 10.0, 500, 600))
    ledger.record_prefill("a", Sent("r2", 60.0, 300, 300))
    state = EndpointState(endpoint_id="a", num_request_waiting=1, prefill_tokens_in_flight=100)
    assert ledger.adjusted(state, published_ms=50.0).num_request_waiting == 2  # r2 only
    assert ledger.adjusted(state, published_ms=0.0).prefill_tokens_in_flight == 900
    ledger.record_decode("d", Sent("r3", 0.0, 0, 800, kv_arrival_ms=120.0, ready_ms=40.0, transfer_ms=80.0))
    decode = EndpointState(endpoint_id="d", role="decode", num_request_running=4, decode_tokens_in_flight=1000)
    later = ledger.adjusted(decode, published_ms=100.0)
    assert (later.num_request_running, later.decode_tokens_in_flight) == (5, 1800)
    assert ledger.adjusted(decode, published_ms=150.0) is decode  # landed before publication: counted there
    assert ledger.link_free_ms("d", now_ms=50.0) == 120.0 and ledger.link_free_ms("d", now_ms=200.0) == 200.0
    assert ledger.link_free_ms("d", now_ms=30.0) == 30.0  # its prefill is not done yet: the link is free
    for rid in ("r1", "r2", "r3"):
        ledger.complete(rid)
    assert len(ledger) == 0 and ledger.adjusted(state, 0.0) is state


def test_the_ledger_counts_sends_recorded_out_of_order_and_again() -> None:
    # A gateway stamps a request's arrival before reading its body, so requests can be recorded out of arrival
    # order, and a retry is recorded again with its first arrival time: every send after the publication counts,
    # once, however it was recorded; a deep queue of older sends does not.
    ledger = InflightLedger()
    for i in range(500):
        ledger.record_prefill("a", Sent(f"old{i}", float(i), 10, 10))
    ledger.record_prefill("a", Sent("late", 1_010.0, 100, 100))
    ledger.record_prefill("a", Sent("early", 1_005.0, 1_000, 1_000))  # arrived earlier, recorded later
    ledger.record_prefill("a", Sent("old3", 3.0, 10, 10))  # a retry, recorded again at its first arrival
    state = EndpointState(endpoint_id="a")
    after = ledger.adjusted(state, published_ms=1_000.0)
    assert (after.num_request_waiting, after.prefill_tokens_in_flight) == (2, 1_100)
    before = ledger.adjusted(state, published_ms=0.0)
    assert (before.num_request_waiting, before.prefill_tokens_in_flight) == (502, 6_100)
    ledger.complete("late")
    assert ledger.adjusted(state, published_ms=1_000.0).num_request_waiting == 1
    assert len(list(ledger.pending("a"))) == 501


def test_in_flight_additions_keep_each_count_within_max_count() -> None:
    """A candidate published at MAX_COUNT waiting, or two prompts of MAX_COUNT tokens sent to one endpoint, made its
    adjusted state refused: `pick` raised FeatureError ("num_request_waiting: must be ≤ 2**53") at every decision
    offering that endpoint until the requests completed."""
    ledger = InflightLedger()
    ledger.record_prefill("a", Sent("r1", 10.0, MAX_COUNT, MAX_COUNT))
    ledger.record_prefill("a", Sent("r2", 10.0, MAX_COUNT, MAX_COUNT))
    ledger.record_decode("d", Sent("r3", 0.0, 0, MAX_COUNT, kv_arrival_ms=120.0))
    full = EndpointState(endpoint_id="a", num_request_waiting=MAX_COUNT)
    after = ledger.adjusted(full, published_ms=0.0)
    assert (after.num_request_waiting, after.prefill_tokens_in_flight) == (MAX_COUNT, MAX_COUNT)
    decode = EndpointState(endpoint_id="d", role="decode", num_request_running=MAX_COUNT, decode_tokens_in_flight=1)
    after = ledger.adjusted(decode, published_ms=0.0)
    assert (after.num_request_running, after.decode_tokens_in_flight) == (MAX_COUNT, MAX_COUNT)
    policy = LeadtimePolicy(QueueModel())
    for i in range(2):
        pick = policy.pick(RouteRequest(f"q{i}", MAX_COUNT, arrival_ms=10.0), [Candidate(full, published_ms=0.0)])
        assert pick.endpoint_id == "a"


def test_the_ledger_keeps_nothing_of_endpoints_whose_requests_all_completed() -> None:
    """In Kubernetes an endpoint's name is its pod's: every rollout brings new names, and a slot kept for each name
    once its requests completed grew the ledger for ever. Meanwhile it counts as a ledger that never saw the
    completed requests: a slot going and coming back changes nothing."""
    rng = np.random.default_rng(7)
    ledger = InflightLedger()
    records: list[tuple[str, str, Sent]] = []  # (side, endpoint, send), in the order recorded
    open_ids: list[str] = []
    for i in range(2_000):
        if open_ids and rng.random() < 0.45:
            done = open_ids.pop(int(rng.integers(len(open_ids))))
            ledger.complete(done)
        else:
            rid = f"r{i}"
            prefill_on, decode_on = f"p{rng.integers(300)}", f"d{rng.integers(300)}"
            sent = Sent(rid, float(rng.uniform(0, 1_000)), 10, 20, kv_arrival_ms=float(rng.uniform(0, 1_000)))
            for side, endpoint in (("prefill", prefill_on), ("prefill", prefill_on), ("decode", decode_on)):
                (ledger.record_prefill if side == "prefill" else ledger.record_decode)(endpoint, sent)
                records.append((side, endpoint, sent))
            if rng.random() < 0.3:  # prefilled locally on its decode endpoint
                ledger.record_prefill(decode_on, sent)
                records.append(("prefill", decode_on, sent))
            open_ids.append(rid)
        if i % 100 == 0:
            fresh = InflightLedger()  # what is open now, recorded in the same order
            for side, endpoint, sent in records:
                if sent.request_id in open_ids:
                    (fresh.record_prefill if side == "prefill" else fresh.record_decode)(endpoint, sent)
            for endpoint in {e for _, e, _ in records}:
                state = EndpointState(endpoint_id=endpoint)
                for at in (0.0, 300.0, 700.0):
                    assert ledger.adjusted(state, at) == fresh.adjusted(state, at)
                    assert ledger.link_free_ms(endpoint, at) == fresh.link_free_ms(endpoint, at)
                assert list(ledger.pending(endpoint)) == list(fresh.pending(endpoint))
    for rid in open_ids:
        ledger.complete(rid)
    assert len(ledger) == 0 and ledger._endpoints == {}


def test_a_burst_is_spread_by_in_flight_accounting() -> None:
    # Endpoint a looks slightly better to every request of the burst: its state was published before any of them.
    candidates = [cand("a", hits=200), cand("b"), cand("c"), cand("d")]

    def route(config: LeadtimeConfig) -> list[str]:
        policy = LeadtimePolicy(QueueModel(), config)
        return [policy.pick(req(f"r{i}", at=1.0 + i * 0.01), candidates).endpoint_id for i in range(8)]

    spread = route(LeadtimeConfig(exploration=0.0))
    assert sorted(spread) == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert route(LeadtimeConfig(inflight=False, exploration=0.0)) == ["a"] * 8


def test_the_decoding_ledger_keeps_each_request_where_it_decodes_until_it_completes() -> None:
    ledger = DecodingLedger()
    ledger.record("a", "r1", 50.0)
    ledger.record("a", "r2", 100.0)
    ledger.record("b", "r3", 100.0)
    assert ledger.inverse_slo_sums(["a", "b", "c"]) == pytest.approx([0.03, 0.01, 0.0])
    ledger.record("b", "r1", 50.0)  # retried elsewhere: it decodes in one place
    assert ledger.inverse_slo_sums(["a", "b"]) == pytest.approx([0.01, 0.03])
    for rid in ("r1", "r2", "r3", "r3", "never-sent"):
        ledger.complete(rid)
    assert len(ledger) == 0 and ledger.inverse_slo_sums(["a", "b"]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="itl_slo_ms"):
        ledger.record("a", "r4", 0.0)


def test_decode_harm_grows_with_the_prefill_and_the_tight_requests_in_flight() -> None:
    sums = np.array([0.0, 1 / 100, 2 / 100, 1 / 50])
    harm = decode_harm(np.full(4, 1000.0), 100.0, sums)
    assert harm.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.2])  # 10 ms more ITL for each request there
    assert decode_harm(np.array([2000.0]), 100.0, sums[1:2])[0] == pytest.approx(0.2)
    assert decode_harm(np.array([1000.0]), 0.0, sums[1:2])[0] == pytest.approx(10.0)  # a mean of < 1 token counts as 1


def test_shared_step_scores_reorder_only_candidates_predicted_in_time_and_keep_them_in_time() -> None:
    rng = np.random.default_rng(3)
    scores, harm = rng.uniform(0, 1, 200), rng.uniform(0, 5, 200)
    shared = shared_step_scores(scores, harm)
    in_time = scores >= FEASIBLE
    assert np.array_equal(shared[~in_time], scores[~in_time])
    assert (shared[in_time] >= FEASIBLE).all() and (shared[in_time] <= scores[in_time]).all()
    assert np.array_equal(shared_step_scores(scores, np.zeros(200)), scores)
    # Equal harm keeps the order; no harm is large enough to tie two candidates that differed.
    equal = shared_step_scores(scores[in_time], np.full(in_time.sum(), 50.0))
    assert np.array_equal(np.argsort(equal, kind="stable"), np.argsort(scores[in_time], kind="stable"))
    assert len(np.unique(equal)) == len(np.unique(scores[in_time]))


def test_a_long_prompt_goes_where_fewer_tight_itl_requests_are_decoding() -> None:
    # a and b publish the same state; a holds part of the prompt (its TTFT is shorter) but this router has sent
    # it twelve requests with a 50 ms ITL SLO that have not completed: the 8,000-token prefill would stall them.
    a, b = cand("a", hits=400), cand("b")
    config = LeadtimeConfig(exploration=0.0, inflight=False)
    policy = LeadtimePolicy(QueueModel(), config)
    blind = LeadtimePolicy(QueueModel(), replace(config, decode_harm=False))
    for p in (policy, blind):
        for i in range(12):
            assert p.pick(req(f"t{i}", itl_slo=50.0), [a]).endpoint_id == "a"
    assert policy.pick(req("long", tokens=8000, at=1.0), [a, b]).endpoint_id == "b"
    assert blind.pick(req("long", tokens=8000, at=1.0), [a, b]).endpoint_id == "a"
    # Once they complete (or are given up), they no longer count.
    for i in range(12):
        if i % 2:
            policy.abandon(f"t{i}")
        else:
            policy.observe(Outcome(f"t{i}", "a", None, ttft_ms=100.0, itl_ms=20.0, output_tokens=200, completed_ms=2.0))
    assert policy.pick(req("long2", tokens=8000, at=3.0), [a, b]).endpoint_id == "a"


def test_with_every_candidate_far_inside_the_slos_the_shortest_mean_ttft_wins_not_the_most_slack() -> None:
    # QueueModel: a (15 running) is predicted a 70 ms TTFT and 40 ms ITL (p90 84 / 48), b (one waiting, none
    # running) 270 / 10 ms (p90 324 / 12). Both are within half of both SLOs. Mean headroom prefers b (0.86
    # against 0.74, its ITL slack); its first token comes 200 ms later.
    candidates = [cand("a", running=15), cand("b", waiting=1)]
    comfort = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, inflight=False))
    assert comfort.pick(req(), candidates).endpoint_id == "a"
    slack = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, inflight=False, comfort=0.0))
    assert slack.pick(req(), candidates).endpoint_id == "b"
    # With a tighter ITL SLO a is no longer far inside it: slack decides again.
    assert comfort.pick(req("r2", itl_slo=80.0), candidates).endpoint_id == "b"


def test_with_a_comfort_tolerance_near_equal_candidates_are_taken_in_turn() -> None:
    # QueueModel, 1,000-token prompts: a (no prefix hit) is predicted a 70 ms TTFT, b (60 tokens cached) 67 ms,
    # c (120 cached) 64 ms, d (one waiting) 270 ms. Without a tolerance c, the shortest, takes every request
    # (in-flight accounting is off, so nothing sent changes the predictions); with 10%, a, b and c are within it
    # of c and take the requests in turn, and d none.
    candidates = [cand("a"), cand("b", hits=60), cand("c", hits=120), cand("d", waiting=1)]

    def route(config: LeadtimeConfig) -> list[str]:
        policy = LeadtimePolicy(QueueModel(), config)
        return [policy.pick(req(f"r{i}", at=float(i)), candidates).endpoint_id for i in range(6)]

    assert route(LeadtimeConfig(exploration=0.0, inflight=False)) == ["c"] * 6
    assert route(LeadtimeConfig(exploration=0.0, inflight=False, comfort_tolerance=0.1)) == ["a", "b", "c"] * 2


def test_the_candidate_in_turn_is_the_one_sent_a_request_longest_ago() -> None:
    near, itl = np.array([100.0, 104.0, 108.0]), np.full(3, 20.0)
    never = -np.inf
    scores = comfortable_scores(near, itl, near, 2000.0, 100.0, 0.5, 0.1, np.array([30.0, never, 10.0]))
    assert scores is not None and int(np.argmax(scores)) == 1 and scores.max() == 1.0
    assert sorted(scores)[-2] < 1.0 and min(scores) >= FEASIBLE  # one winner; all still predicted in time
    # Outside the tolerance the shortest mean wins whatever was sent when; no tolerance or no record: as before.
    far = np.array([100.0, 130.0, 160.0])
    spread = comfortable_scores(far, itl, far, 2000.0, 100.0, 0.5, 0.1, np.array([30.0, 0.0, 0.0]))
    assert spread is not None and int(np.argmax(spread)) == 0
    plain = comfortable_scores(near, itl, near, 2000.0, 100.0, 0.5)
    unrecorded = comfortable_scores(near, itl, near, 2000.0, 100.0, 0.5, 0.1, None)
    assert plain is not None and unrecorded is not None and int(np.argmax(plain)) == 0
    assert unrecorded.tolist() == plain.tolist()


def test_requests_beyond_saving_go_to_one_overflow_endpoint_not_all_over_the_fleet() -> None:
    # Every endpoint has a queue predicted at several times the TTFT SLO: each request is beyond saving wherever it
    # goes. Spread at random, they would slow every endpoint down; they all go to the first such endpoint.
    candidates = [cand(name, waiting=40) for name in ("a", "b", "c", "d")]
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, inflight=False))
    picks = {policy.pick(req(f"r{i}", at=float(i)), candidates).endpoint_id for i in range(20)}
    assert picks == {"a"}
    # One endpoint that can still serve in time takes the requests instead.
    candidates[2] = cand("c")
    assert policy.pick(req("s", at=30.0), candidates).endpoint_id == "c"


def test_named_overflow_endpoints_take_requests_beyond_saving_first_in_their_order() -> None:
    # As above, every request is beyond saving everywhere; the operator named c, then b, to take them.
    candidates = [cand(name, waiting=40) for name in ("a", "b", "c", "d")]
    config = LeadtimeConfig(exploration=0.0, inflight=False, overflow_endpoints=("c", "b"))
    policy = LeadtimePolicy(QueueModel(), config)
    assert {policy.pick(req(f"r{i}", at=float(i)), candidates).endpoint_id for i in range(10)} == {"c"}
    # c gone (drained, or not a candidate): the next one named; none named among them: the candidates' order.
    assert policy.pick(req("s1", at=20.0), [c for c in candidates if c.endpoint_id != "c"]).endpoint_id == "b"
    assert policy.pick(req("s2", at=21.0), [candidates[0], candidates[3]]).endpoint_id == "a"
    # With the cap (capacity to spare), the named endpoint takes them until it is past it, then the next named:
    # 20 waiting is within 3 × 2 s of predicted wait for five requests (see the next test).
    capped = [cand("a", waiting=20), cand("b", waiting=20), cand("c", waiting=20)]
    bounded = LeadtimePolicy(QueueModel(), replace(config, inflight=True, overflow_cap=3.0))
    picks = [bounded.pick(req(f"t{i}", at=float(i)), capped).endpoint_id for i in range(10)]
    assert picks == ["c"] * 5 + ["b"] * 5
    # A request that can be served in time still goes where it can.
    assert policy.pick(req("u", at=30.0), [*candidates[:3], cand("d")]).endpoint_id == "d"


def test_the_overflow_endpoint_takes_requests_beyond_saving_only_up_to_its_cap() -> None:
    # QueueModel's p90 TTFT for a 1,000-token prompt: 1.2 × (70 + 200 × waiting) ms. With 20 waiting (4.9 s) a
    # request misses its 2 s SLO by more than the SLO: beyond saving, but within the cap of 3 × 2 s = 6 s, which
    # 40 waiting (9.7 s) is past. Each request sent adds one in flight (+240 ms): five fit under the cap.
    candidates = [cand("a", waiting=40), cand("b", waiting=20), cand("c", waiting=20), cand("d", waiting=40)]
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, overflow_cap=3.0))
    picks = [policy.pick(req(f"r{i}", at=float(i)), candidates).endpoint_id for i in range(11)]
    # b until it passes the cap, then c; then every one is past it: the shortest predicted wait (b, first of b/c).
    assert picks == ["b"] * 5 + ["c"] * 5 + ["b"]
    # Short of capacity (more than a quarter of recent decisions found no candidate in time) the overflow endpoint
    # is not capped: the first candidate takes everything beyond saving.
    for share in (0.3, 1.0):
        short = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, overflow_cap=3.0))
        short.overload = share
        assert {short.pick(req(f"o{i}", at=float(i)), candidates).endpoint_id for i in range(5)} == {"a"}


def test_a_request_whose_mean_predictions_meet_the_slos_is_not_given_up_under_overload() -> None:
    # Sustained overload (sink mode): a request predicted to miss everywhere goes to the endpoint already beyond
    # saving (a, 40 waiting). b and c miss the ITL SLO only at the p90 (QueueModel: 1.2 × (10 + 2 × 42) = 113 ms
    # against 100 ms) while their means meet it (94 ms): the request is more likely than not served in time there.
    candidates = [cand("a", waiting=40), cand("b", running=42), cand("c", running=42)]
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, inflight=False))
    policy.overload = 1.0
    assert policy.pick(req("r1"), candidates).endpoint_id in ("b", "c")
    # With means that miss too (10 + 2 × 50 = 110 ms), it is beyond saving everywhere: the overflow endpoint.
    candidates[1:] = [cand("b", running=50), cand("c", running=50)]
    assert policy.pick(req("r2"), candidates).endpoint_id == "a"
    # The same rule on P/D pairs: the decode endpoints' mean ITLs decide whether the request is given up.
    prefill = [cand("p1", role="prefill", waiting=40), cand("p2", role="prefill")]
    decode = [cand("d1", role="decode", running=42), cand("d2", role="decode", running=42)]
    pd = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, inflight=False, local_prefill=False))
    pd.overload = 1.0
    assert pd.pick(req("r3"), prefill + decode).endpoint_id == "p2"


def test_a_request_in_time_on_some_mean_is_placed_by_the_means_whatever_the_overload() -> None:
    """Regression: a request whose p90s all missed by the SLO or more (scores tied at 0) went to the overflow
    endpoint, even where its mean predictions met the SLOs elsewhere, unless the fleet was in sink mode: on the
    time-sliced fleet 44% of the requests so judged met both SLOs, and the overflow endpoint built a backlog of
    100 s. Given up only when no mean meets the SLOs (`scorers.latency.preference`), it is placed by its means."""

    class WideItl(QueueModel):
        def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
            answer = super().predict(rows, deadline_s)  # ITL p90 three times its mean: a wide spread
            return replace(answer, tpot_quantile_ms=3.0 * answer.tpot_mean_ms)

    # a's mean ITL (10 + 2 x 95 = 200 ms) misses the 100 ms SLO; b's (80 ms) meets it, but its p90 (240 ms) misses
    # by more than the SLO, as a's does: both score 0 on the p90s.
    candidates = [cand("a", running=95), cand("b", running=35)]
    for overload in (0.0, 0.3, 1.0):  # the cap held, the cap let go, sink mode
        policy = LeadtimePolicy(WideItl(), LeadtimeConfig(exploration=0.0, inflight=False))
        policy.overload = overload
        assert policy.pick(req("r"), candidates).endpoint_id == "b", overload
    # The same on P/D pairs: the decode endpoint whose mean ITL meets the SLO.
    p = PairPredictions(
        prefill_ttft=np.array([300.0, 300.0]),
        prefill_ttft_mean=np.array([250.0, 250.0]),
        decode_itl=np.array([600.0, 240.0]),
        decode_itl_mean=np.array([200.0, 80.0]),
        local_ttft=None,
        local_ttft_mean=None,
        link_free_ms=np.array([0.0, 0.0]),
        transfer_ms=np.array([50.0, 50.0]),
    )
    for fit in (("most_slack", 0.0, "least_bad"), ("most_slack", 0.0, "sink")):
        for cap in (None, 6000.0):
            assert choose_pair(p, 0.0, 2000.0, 100.0, fit=fit, overflow_cap_ms=cap).decode == 1, (fit, cap)


# ------------------------------------------------------------------------------ learning and fallback


def test_observations_carry_the_scored_features_actuals_and_predictions() -> None:
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0))
    first = policy.pick(req("r1", at=5.0), [cand("a")])
    second = policy.pick(req("r2", at=6.0), [cand("a")])
    assert second.row is not None and second.row.endpoint.num_request_waiting == 1  # r1 added in flight
    policy.observe(Outcome("r2", "a", None, ttft_ms=480.0, itl_ms=12.5, output_tokens=40, completed_ms=900.0))
    (obs,) = model.told
    assert obs.row == second.row
    assert (obs.actual_ttft_ms, obs.actual_tpot_ms) == (480.0, 12.5)
    assert obs.predicted_ttft_ms == second.predicted_ttft_ms and obs.predicted_tpot_ms == second.predicted_tpot_ms
    # the upper quantiles too (the service measures live coverage on them): QueueModel's are 1.2 × its means
    assert second.predicted_ttft_ms is not None and second.predicted_tpot_ms is not None
    assert obs.predicted_ttft_quantile_ms == pytest.approx(1.2 * second.predicted_ttft_ms)
    assert obs.predicted_tpot_quantile_ms == pytest.approx(1.2 * second.predicted_tpot_ms)
    assert obs.timestamp == pytest.approx(0.9)
    assert first.row is not None and first.row.endpoint.num_request_waiting == 0
    # A request of one output token has no ITL to learn.
    policy.observe(Outcome("r1", "a", None, ttft_ms=300.0, itl_ms=0.0, output_tokens=1, completed_ms=950.0))
    assert model.told[-1].actual_tpot_ms == 0.0 and model.told[-1].predicted_tpot_ms is None
    assert model.told[-1].predicted_tpot_quantile_ms is None


def test_a_failing_predictor_falls_back_to_the_heuristics_and_routing_goes_on() -> None:
    policy = LeadtimePolicy(QueueModel(fail=True), LeadtimeConfig())
    pick = policy.pick(req(), [cand("a", waiting=5), cand("b", waiting=0)])
    assert pick.endpoint_id == "b" and pick.row is None  # llm-d's queue scorer decides
    assert policy.counters.fallbacks == 1


class Answering(QueueModel):
    """Answers `ttft` (quantile and mean) whatever the rows, as a remote predictor might."""

    def __init__(self, ttft: list[float]) -> None:
        super().__init__()
        self.ttft = np.array(ttft)

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        n = len(rows)
        return BulkPredictions(self.ttft, 1.2 * self.ttft, np.full(n, 10.0), np.full(n, 12.0), 1, 0.9)


@pytest.mark.parametrize(
    "ttft", [[200.0, 200.0, math.nan], [200.0, math.inf, 200.0], [200.0, 200.0], [200.0, 2e12, 200.0]]
)
def test_a_prediction_missing_or_not_finite_falls_back_to_the_heuristics(ttft: list[float]) -> None:
    """Regression: one NaN prediction (a native answer's null, or NaN/inf over gRPC) made `pick` raise IndexError
    instead of routing, and counted the decision as overloaded; a short answer was taken as it came. One beyond what
    a prediction may say (`MAX_PREDICTED_MS`) was routed on, and the outcome's `observe` then raised FeatureError."""
    policy = LeadtimePolicy(Answering(ttft), LeadtimeConfig(exploration=0.0, comfort=0.0))
    pick = policy.pick(req(), [cand("a", waiting=5), cand("b"), cand("c", waiting=5)])
    assert pick.endpoint_id == "b" and pick.row is None  # llm-d's queue scorer decides
    assert policy.counters.fallbacks == 1 and policy.overload == 0.0
    assert isinstance(policy.fallback_error, PredictorError) and policy.fallback_error.status == "invalid_answer"


def test_a_candidate_the_predictor_refuses_is_said_once_not_at_every_decision(caplog: pytest.LogCaptureFixture) -> None:
    """One endpoint of a class the predictor does not know sent every decision it was a candidate of to the
    heuristics, and nothing said why until its request completed (the observation's refusal)."""
    policy = LeadtimePolicy(InProcessPredictor(OnlinePredictor(LearnerConfig(background=False))), LeadtimeConfig())
    unknown = Candidate(replace(cand("x").state, accelerator="tpu-x"), 0, 0.0, "")
    with caplog.at_level(logging.WARNING, logger="leadtime.router"):
        for i in range(3):
            policy.pick(req(f"r{i}", at=float(i)), [cand("a"), unknown] if i % 2 else [unknown, cand("a")])
    assert policy.counters.fallbacks == 3
    said = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len(said) == 1 and "unknown accelerator class 'tpu-x'" in said[0], said


def test_a_request_decided_by_the_fallback_is_counted_in_flight_and_learned_from() -> None:
    # The predictor misses its deadline exactly when endpoints are busiest: dropping those requests' outcomes
    # would teach the model least about the moments that matter most (and lost 2 of 8 observations in the
    # gateway's end-to-end test on a loaded machine).
    model = QueueModel(fail=True)
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0))
    candidates = [cand("a", waiting=5), cand("b")]
    assert policy.pick(req("r1", at=1.0), candidates).endpoint_id == "b"
    model.fail = False
    policy.pick(req("r2", at=2.0), candidates)
    assert [r.endpoint.num_request_waiting for r in model.asked[-1]] == [5, 1]  # r1 is in flight on b
    policy.observe(Outcome("r1", "b", None, 100.0, 10.0, 5, 200.0))
    (told,) = model.told
    assert told.row.endpoint.endpoint_id == "b" and told.row.endpoint.num_request_waiting == 0
    assert (told.actual_ttft_ms, told.actual_tpot_ms) == (100.0, 10.0)
    assert told.predicted_ttft_ms is None and told.predicted_tpot_ms is None  # nothing was predicted


def test_a_pd_pair_decided_by_the_fallback_is_learned_on_both_rows() -> None:
    model = QueueModel(fail=True)
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0, kv_link_gb_s=10.0))
    candidates = [cand("p0", role="prefill", waiting=3), cand("p1", role="prefill"), cand("d0", role="decode")]
    pick = policy.pick(req("r", tokens=4000), candidates)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p1", "d0")
    policy.observe(Outcome("r", "p1", "d0", ttft_ms=700.0, itl_ms=15.0, output_tokens=50, completed_ms=2000.0))
    prefill_obs, decode_obs = model.told
    assert prefill_obs.row.endpoint.endpoint_id == "p1" and 0 < prefill_obs.actual_ttft_ms < 700.0  # less the transfer
    assert decode_obs.row.endpoint.endpoint_id == "d0" and decode_obs.row.endpoint.role == "decode"
    assert decode_obs.actual_tpot_ms == 15.0 and decode_obs.predicted_tpot_ms is None


def test_a_pd_pair_decided_by_the_fallback_counts_in_flight_on_its_decode_endpoint() -> None:
    """Regression: a fallback decision on P/D was recorded on its prefill endpoint only: the decode endpoint's
    running count, decode tokens and KV link looked free of it, and the next decisions piled onto it."""
    policy = LeadtimePolicy(QueueModel(fail=True), LeadtimeConfig(exploration=0.0, kv_link_gb_s=10.0))
    candidates = [cand("p0", role="prefill"), cand("d0", role="decode")]
    pick = policy.pick(req("r", tokens=4000, at=10.0), candidates)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p0", "d0")
    decode = policy.ledgers.inflight.adjusted(candidates[1].state, published_ms=0.0)
    assert decode.num_request_running == 1 and decode.decode_tokens_in_flight == 4000
    # Prefilled by ~90 ms (the roofline's 4000 tokens on an H100), its 50 ms transfer then holds the link.
    assert policy.ledgers.inflight.link_free_ms("d0", now_ms=100.0) > 120.0
    policy.observe(Outcome("r", "p0", "d0", ttft_ms=700.0, itl_ms=15.0, output_tokens=50, completed_ms=2000.0))
    assert policy.ledgers.inflight.adjusted(candidates[1].state, published_ms=0.0).num_request_running == 0


def test_the_in_process_client_satisfies_the_protocol_and_learns() -> None:
    client = InProcessPredictor(OnlinePredictor(LearnerConfig(background=False)))
    assert isinstance(client, PredictorClient)
    policy = LeadtimePolicy(client)
    assert isinstance(policy, RoutingPolicy)
    row = policy.pick(req(), [cand("a"), cand("b", waiting=3)]).row
    assert row is not None
    before = client.predict([row]).ttft_mean_ms[0]
    for _ in range(40):
        client.observe([Observation(row, actual_ttft_ms=before * 3, actual_tpot_ms=30.0)])
    assert client.predict([row]).ttft_mean_ms[0] > 1.5 * before


def test_the_in_process_client_answers_what_the_service_would_serve() -> None:
    """An in-process learner's overflow (a queue of 2**50 requests predicted at 6e15 ms), NaN or negative was
    handed on as it was: the policy refused it as "what cannot be routed on" and each such decision fell back to
    the heuristics, while the service serves an overflow as MAX_PREDICTED_MS and the others as 0 and routes on it."""

    class Answering:
        def predict_many(self, rows: Sequence[FeatureRow]) -> Any:
            values = np.array([1e16, float("nan"), -5.0, 7.0])
            return SimpleNamespace(ttft_mean=values, ttft_quantile=values, tpot_mean=values, tpot_quantile=values)

        def learn_many(self, observations: Sequence[Observation]) -> None:
            pass

    answer = InProcessPredictor(Answering()).predict([cand(e).row(req()) for e in "abcd"])
    assert answer.ttft_mean_ms.tolist() == answer.tpot_quantile_ms.tolist() == [MAX_PREDICTED_MS, 0.0, 0.0, 7.0]
    policy = LeadtimePolicy(InProcessPredictor(OnlinePredictor(LearnerConfig(background=False))))
    policy.pick(req(), [cand("a", waiting=2**50), cand("b", waiting=2**50)])
    assert policy.counters.fallbacks == 0


# ------------------------------------------------------------------------------ P/D pairs


def test_the_joint_choice_beats_decode_first_when_the_decode_endpoint_should_prefill_itself() -> None:
    # A long prompt on a slow KV link: prefill elsewhere (700 ms) plus the transfer (400 ms) misses the 1 s TTFT
    # SLO, the decode endpoint prefilling itself (600 ms) does not. llm-d's order (decode, then prefill, always
    # disaggregated above its threshold) cannot see that.
    p = PairPredictions(
        prefill_ttft=np.array([700.0, 900.0]),
        prefill_ttft_mean=np.array([600.0, 800.0]),
        decode_itl=np.array([30.0, 25.0]),
        decode_itl_mean=np.array([25.0, 20.0]),
        local_ttft=np.array([600.0, 650.0]),
        local_ttft_mean=np.array([500.0, 550.0]),
        link_free_ms=np.array([0.0, 0.0]),
        transfer_ms=np.array([400.0, 400.0]),
    )
    joint = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0)
    first = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0, decode_first=True)
    assert joint.prefill is None and joint.ttft_ms <= 1000.0
    assert first.prefill == 0 and first.ttft_ms == 1100.0  # a miss


def test_decode_first_weighs_the_decode_endpoints_link_before_choosing_the_prefill() -> None:
    p = PairPredictions(
        prefill_ttft=np.array([400.0, 380.0]),
        prefill_ttft_mean=np.array([300.0, 290.0]),
        decode_itl=np.array([40.0, 20.0]),
        decode_itl_mean=np.array([35.0, 15.0]),
        local_ttft=None,
        local_ttft_mean=None,
        link_free_ms=np.array([0.0, 3000.0]),
        transfer_ms=np.array([50.0, 50.0]),
    )
    first = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0, decode_first=True)
    assert (first.prefill, first.decode) == (1, 0)  # decode 1 has the better ITL but its link is busy for 3 s


def test_decode_first_spreads_requests_beyond_saving_by_their_predicted_ttft() -> None:
    # Every pair misses the 1 s TTFT SLO by more than the SLO: all score 0. The least bad, not the first, wins.
    p = PairPredictions(
        prefill_ttft=np.array([9000.0, 5000.0]),
        prefill_ttft_mean=np.array([8000.0, 4000.0]),
        decode_itl=np.array([20.0, 20.0]),
        decode_itl_mean=np.array([18.0, 18.0]),
        local_ttft=None,
        local_ttft_mean=None,
        link_free_ms=np.array([4000.0, 0.0]),
        transfer_ms=np.array([50.0, 50.0]),
    )
    first = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0, decode_first=True)
    assert (first.prefill, first.decode) == (1, 1)


def test_the_joint_choice_sends_pairs_beyond_saving_to_an_overflow_pair_within_its_cap() -> None:
    # Every option misses the 1 s TTFT SLO by more than the SLO (all score 0). Uncapped, the first pair takes it
    # (prefill 0, decode 0: 9 s); capped at 6 s, the first pair within the cap (prefill 1, decode 0: 4 s) does.
    p = PairPredictions(
        prefill_ttft=np.array([9000.0, 4000.0]),
        prefill_ttft_mean=np.array([8000.0, 3500.0]),
        decode_itl=np.array([20.0, 20.0]),
        decode_itl_mean=np.array([18.0, 18.0]),
        local_ttft=None,
        local_ttft_mean=None,
        link_free_ms=np.array([0.0, 0.0]),
        transfer_ms=np.array([50.0, 50.0]),
    )
    uncapped = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0)
    capped = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0, overflow_cap_ms=6000.0)
    assert (uncapped.prefill, uncapped.decode) == (0, 0)
    assert (capped.prefill, capped.decode) == (1, 0)
    # Every option past the cap: the shortest predicted TTFT.
    tight = choose_pair(p, 0.0, ttft_slo_ms=1000.0, itl_slo_ms=60.0, overflow_cap_ms=2000.0)
    assert (tight.prefill, tight.decode, tight.ttft_ms) == (1, 0, 4050.0)


def test_named_overflow_endpoints_order_pairs_beyond_saving_by_their_prefill_endpoint() -> None:
    # Every option misses by more than the SLO; the operator named prefill endpoint 1, so its pair takes it.
    p = PairPredictions(
        prefill_ttft=np.array([9000.0, 12000.0]),
        prefill_ttft_mean=np.array([8000.0, 11000.0]),
        decode_itl=np.array([20.0, 20.0]),
        decode_itl_mean=np.array([18.0, 18.0]),
        local_ttft=np.array([15000.0, 14000.0]),
        local_ttft_mean=np.array([14000.0, 13000.0]),
        link_free_ms=np.array([0.0, 0.0]),
        transfer_ms=np.array([50.0, 50.0]),
    )
    named_prefill = choose_pair(p, 0.0, 1000.0, 60.0, overflow_rank=(np.array([1, 0]), np.array([2, 2])))
    assert (named_prefill.prefill, named_prefill.decode) == (1, 0)
    # A decode endpoint named first takes it as a local prefill.
    named_decode = choose_pair(p, 0.0, 1000.0, 60.0, overflow_rank=(np.array([2, 2]), np.array([2, 0])))
    assert (named_decode.prefill, named_decode.decode) == (None, 1)
    unnamed = choose_pair(p, 0.0, 1000.0, 60.0)  # the first pair, as without names
    assert (unnamed.prefill, unnamed.decode) == (0, 0)


def test_decode_first_sends_a_short_prompt_beyond_saving_to_the_named_overflow_endpoint() -> None:
    """Regression: in decode-first mode a short prompt scores no prefill endpoint, yet their overflow ranks were
    still passed: the ranks no longer lined up with the options and the named overflow endpoint was ignored."""

    class Slow(QueueModel):
        def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
            far = np.full(len(rows), 60_000.0)
            return BulkPredictions(far, far, np.full(len(rows), 10.0), np.full(len(rows), 12.0), 1, 0.9)

    config = LeadtimeConfig(
        joint_pairs=False, exploration=0.0, overflow="least_bad", overflow_cap=0.0, overflow_endpoints=("d1",)
    )
    policy = LeadtimePolicy(Slow(), config)
    candidates = [cand("p0", role="prefill"), cand("d0", role="decode"), cand("d1", role="decode")]
    pick = policy.pick(req("r", tokens=8, ttft_slo=500.0), candidates)  # below disaggregate_min_tokens
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("d1", None)


def test_overflow_ranks_that_do_not_match_the_predictions_are_refused() -> None:
    """Regression: ranks longer than the options they order were cut silently, ranking options by the wrong
    endpoints' places."""
    p = PairPredictions(
        prefill_ttft=np.zeros(0),
        prefill_ttft_mean=np.zeros(0),
        decode_itl=np.array([20.0, 20.0]),
        decode_itl_mean=np.array([18.0, 18.0]),
        local_ttft=np.array([9000.0, 9000.0]),
        local_ttft_mean=np.array([8000.0, 8000.0]),
        link_free_ms=np.array([0.0, 0.0]),
        transfer_ms=np.array([50.0, 50.0]),
    )
    with pytest.raises(ValueError, match="1 prefill overflow ranks for 0 prefill endpoints"):
        choose_pair(p, 0.0, 1000.0, 60.0, overflow_rank=(np.array([1]), np.array([1, 0])))
    with pytest.raises(ValueError, match="1 decode overflow ranks for 2 decode endpoints"):
        choose_pair(p, 0.0, 1000.0, 60.0, overflow_rank=(np.zeros(0), np.array([1])))


def test_a_short_prompt_is_prefilled_on_the_decode_endpoint_when_that_is_faster() -> None:
    p = PairPredictions(
        prefill_ttft=np.array([900.0]),
        prefill_ttft_mean=np.array([800.0]),
        decode_itl=np.array([20.0]),
        decode_itl_mean=np.array([18.0]),
        local_ttft=np.array([60.0]),
        local_ttft_mean=np.array([50.0]),
        link_free_ms=np.array([0.0]),
        transfer_ms=np.array([5.0]),
    )
    choice = choose_pair(p, 0.0, 2000.0, 100.0)
    assert choice.prefill is None and choice.decode == 0 and choice.transfer_ms == 0.0


def test_a_decode_endpoint_excluded_from_local_prefill_is_not_chosen_for_it() -> None:
    # d0 would prefill fastest itself but may not (inf); d1 may, and does, rather than disaggregating.
    p = PairPredictions(
        prefill_ttft=np.array([900.0]),
        prefill_ttft_mean=np.array([800.0]),
        decode_itl=np.array([20.0, 30.0]),
        decode_itl_mean=np.array([18.0, 25.0]),
        local_ttft=np.array([np.inf, 90.0]),
        local_ttft_mean=np.array([np.inf, 80.0]),
        link_free_ms=np.array([0.0, 0.0]),
        transfer_ms=np.array([5.0, 5.0]),
    )
    choice = choose_pair(p, 0.0, 2000.0, 100.0)
    assert (choice.prefill, choice.decode, choice.ttft_mean_ms) == (None, 1, 80.0)
    everywhere_inf = replace(p, local_ttft=np.array([np.inf, np.inf]), local_ttft_mean=np.array([np.inf, np.inf]))
    assert choose_pair(everywhere_inf, 0.0, 2000.0, 100.0).prefill == 0


def test_a_decode_endpoint_prefills_locally_only_while_it_decodes_far_inside_the_itl_slo() -> None:
    # QueueModel's ITL p90 is 1.2 x (10 + 2 x running) ms: 36 ms with 10 running, 60 ms with 20. A short prompt
    # is predicted faster prefilled on the decode endpoint than on a prefill endpoint with a queue (waiting=3).
    prefill = [cand("p0", role="prefill", waiting=3)]

    def where(running: int, share: float = 0.5) -> str | None:
        policy = LeadtimePolicy(
            QueueModel(), LeadtimeConfig(exploration=0.0, inflight=False, local_prefill_itl_share=share)
        )
        pick = policy.pick(req("r", tokens=200), [*prefill, cand("d0", role="decode", running=running)])
        return pick.endpoint_id

    assert where(10) == "d0"  # 36 ms: within half of the 100 ms ITL SLO, it prefills the request itself
    assert where(20) == "p0"  # 60 ms: its decodes would slow down for every request on it; disaggregated
    assert where(20, share=1.0) == "d0"  # allowed whenever the SLO is predicted met


def test_a_transfer_still_behind_a_deep_prefill_queue_does_not_hold_the_link_for_later_requests() -> None:
    """The link sends KV in the order prefills finish: a request sent to a prefill queue a minute deep must not
    make every later pair on its decode endpoint wait that minute (idle pairs were predicted at ~1 s for requests
    that took 20 ms)."""
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, local_prefill=False, kv_link_gb_s=10.0))
    deep, idle, decode = cand("p0", role="prefill", waiting=300), cand("p1", role="prefill"), cand("d0", role="decode")
    first = policy.pick(req("r1", tokens=2000), [deep, decode])
    assert first.predicted_ttft_ms is not None and first.predicted_ttft_ms > 50_000
    later = policy.pick(req("r2", tokens=2000, at=100.0), [idle, decode])
    assert later.predicted_ttft_ms is not None and later.predicted_ttft_ms < 1_000


def test_pd_policy_learns_prefill_ttft_without_the_transfer_and_itl_on_the_decode_row() -> None:
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0, local_prefill=False, kv_link_gb_s=10.0))
    candidates = [
        cand("p0", role="prefill"),
        cand("p1", role="prefill", waiting=4),
        cand("d0", role="decode", running=30),
        cand("d1", role="decode"),
    ]
    pick = policy.pick(req("r", tokens=4000), candidates)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p0", "d1")
    assert pick.row is not None and pick.decode_row is not None and pick.decode_row.endpoint.role == "decode"
    ready = policy.ledgers.inflight._endpoints["d1"].decode["r"].ready_ms
    # once r's prefill is done its transfer holds d1's link
    assert policy.ledgers.inflight.link_free_ms("d1", ready) > ready
    policy.observe(Outcome("r", "p0", "d1", ttft_ms=700.0, itl_ms=15.0, output_tokens=50, completed_ms=2000.0))
    prefill_obs, decode_obs = model.told
    assert prefill_obs.row == pick.row and 0 < prefill_obs.actual_ttft_ms < 700.0 and prefill_obs.actual_tpot_ms == 0
    # The prefill row carries what was predicted for it (the prefill endpoint's own TTFT, not the pair's), so its
    # live error is measured too.
    own = QueueModel().predict([pick.row])
    assert prefill_obs.predicted_ttft_ms == pytest.approx(float(own.ttft_mean_ms[0]))
    assert prefill_obs.predicted_ttft_quantile_ms == pytest.approx(float(own.ttft_quantile_ms[0]))
    assert prefill_obs.predicted_ttft_ms is not None and pick.predicted_ttft_ms is not None
    assert pick.predicted_ttft_ms > prefill_obs.predicted_ttft_ms  # the pair waits for the transfer too
    assert decode_obs.row == pick.decode_row and decode_obs.actual_tpot_ms == 15.0 and decode_obs.actual_ttft_ms == 0
    assert decode_obs.predicted_tpot_ms is not None
    assert decode_obs.predicted_tpot_quantile_ms == pytest.approx(1.2 * decode_obs.predicted_tpot_ms)
    assert policy.ledgers.inflight.link_free_ms("d1", ready) == ready  # completed: nothing of r is left in flight


# ------------------------------------------------------------------------------ time-slicing


class Groups:
    def __init__(self, statuses: dict[str, GroupStatus]) -> None:
        self.statuses = statuses

    def status(self, group: str) -> GroupStatus | None:
        return self.statuses.get(group)


class AtTheBound(QueueModel):
    """Predicts every TTFT at `MAX_PREDICTED_MS`, as the service serves one that overflows."""

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        n = len(rows)
        return BulkPredictions(
            np.full(n, MAX_PREDICTED_MS), np.full(n, MAX_PREDICTED_MS), np.full(n, 10.0), np.full(n, 12.0), 1, 0.9
        )


def test_a_prediction_at_the_bound_stays_there_with_the_swap_out_risk_and_its_outcome_is_learned() -> None:
    """Regression: the service serves an overflow as `MAX_PREDICTED_MS`; stretched by a serving time-sliced
    endpoint's swap-out risk it passed the bound, and the outcome's `observe` raised FeatureError, unlearned."""
    model = AtTheBound()
    source = Groups({"rl": GroupStatus("LOCKED", "inference", "inference", 0, 0.0)})
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    pick = policy.pick(req("r1", at=10.0), [cand("a", group="rl")])
    assert pick.predicted_ttft_ms == MAX_PREDICTED_MS
    policy.observe(Outcome("r1", "a", None, 120.0, 11.0, 8, 900.0))
    assert policy.counters.learned == 1 and model.told[0].predicted_ttft_ms == MAX_PREDICTED_MS


def test_a_pairs_prediction_at_the_bound_stays_there_with_its_transfer_and_its_outcome_is_learned() -> None:
    """Regression: a P/D pair's TTFT is its prefill's plus the KV transfer; with the prefill predicted at
    `MAX_PREDICTED_MS` (an overflow, as the service serves it) the pair passed the bound, and the outcome's `observe`
    raised FeatureError (`simulate` stopped there, naming no setting)."""
    model = AtTheBound()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0, local_prefill=False, kv_link_gb_s=10.0))
    pick = policy.pick(req("r1", tokens=4000, at=10.0), [cand("p0", role="prefill"), cand("d0", role="decode")])
    assert pick.predicted_ttft_ms == MAX_PREDICTED_MS
    policy.observe(Outcome("r1", "p0", "d0", 120.0, 11.0, 8, 900.0))
    assert policy.counters.learned == 2


def test_non_resident_endpoints_are_filtered_out() -> None:
    source = Groups({"rl": GroupStatus("LOCKED", "training", "training", 1, 0.0)})
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0), timeslice_source=source)
    # The shared endpoint looks idle, but its group is held by the training job.
    candidates = [cand("shared", group="rl"), cand("dedicated", waiting=3)]
    assert policy.pick(req(), candidates).endpoint_id == "dedicated"
    assert policy.counters.timeslice_filtered == 1
    blind = LeadtimePolicy(QueueModel(), LeadtimeConfig(timeslice=False, exploration=0.0), timeslice_source=source)
    assert blind.pick(req(), candidates).endpoint_id == "shared"


def test_away_endpoints_compete_with_their_wait_when_no_serving_one_is_predicted_in_time() -> None:
    source = Groups({"rl": GroupStatus("LOCKED", "training", "training", 1, 0.0)})
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    # The dedicated endpoint's queue (30 waiting: ~6 s) misses the 4 s TTFT SLO; the shared one is expected back
    # within the prior's 5 s away time: also a miss, but a smaller one, and it will serve its queue when back.
    pick = policy.pick(req(ttft_slo=4000.0), [cand("shared", group="rl"), cand("dedicated", waiting=30)])
    assert pick.endpoint_id == "shared"
    rows = {r.endpoint.endpoint_id: r.endpoint for r in model.asked[-1]}
    assert rows["shared"].timeslice_state == "parked" and rows["shared"].timeslice_wait_ms > 0
    assert policy.counters.timeslice_filtered == 0
    # With the dedicated endpoint in time, the away one is left out, however it is predicted.
    pick = policy.pick(req("r2", ttft_slo=2000.0), [cand("shared", group="rl"), cand("dedicated", waiting=2)])
    assert pick.endpoint_id == "dedicated" and policy.counters.timeslice_filtered == 1


def test_when_every_candidate_is_away_each_is_scored_with_its_expected_wait() -> None:
    source = Groups(
        {
            "g1": GroupStatus("LOCKED", "training", "training", 1, 0.0),
            "g2": GroupStatus("SWITCHING", "", "inference", 0, 9_900.0),
        }
    )
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    pick = policy.pick(req(at=10_000.0), [cand("a", group="g1"), cand("b", group="g2")])
    assert pick.endpoint_id == "b"  # restoring already: back within ~100 ms, where g1 may be away for seconds
    waits = {r.endpoint.endpoint_id: r.endpoint.timeslice_wait_ms for r in model.asked[-1]}
    assert 0.0 <= waits["b"] < 100.0 < waits["a"]
    assert all(r.endpoint.timeslice_state == "parked" for r in model.asked[-1])
    assert policy.counters.all_non_resident == 1


def test_on_p_d_a_swapped_out_prefill_endpoint_never_gets_a_whole_request() -> None:
    """Every prefill endpoint away: the decode endpoints serve whole requests, and the prefill ones, let back in as
    whole-request candidates when no decode endpoint was predicted in time, were sent clients alone (12 of 24)."""
    source = Groups({"rl": GroupStatus("LOCKED", "training", "training", 1, 0.0)})
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0), timeslice_source=source)
    candidates = [cand("p0", role="prefill", group="rl"), cand("d0", role="decode", waiting=40)]
    for i in range(5):
        pick = policy.pick(req(f"r{i}", tokens=7500, ttft_slo=300.0), candidates)
        assert (pick.endpoint_id, pick.decode_endpoint_id) == ("d0", None), pick


def test_on_p_d_with_every_decode_endpoint_away_requests_wait_for_one_instead_of_a_503() -> None:
    """Every decode endpoint's group away: each request was refused (503 "P/D fleet has no decode endpoint"),
    where a unified fleet in the same state queues on its away endpoints for when they are back."""
    source = Groups({"rl": GroupStatus("LOCKED", "training", "training", 1, 0.0)})
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    candidates = [cand("p0", role="prefill"), cand("d0", role="decode", group="rl")]
    pick = policy.pick(req(), candidates)
    assert (pick.endpoint_id, pick.decode_endpoint_id) == ("p0", "d0")
    assert policy.counters.all_non_resident == 1
    waits = {r.endpoint.endpoint_id: r.endpoint.timeslice_wait_ms for r in model.asked[-1]}
    assert waits["d0"] > 0  # scored with its expected wait


def test_on_p_d_with_every_decode_endpoint_away_a_serving_prefill_endpoint_is_predicted_resident() -> None:
    """Regression: with every decode endpoint's group away, every candidate's row was built as parked, so prefill
    endpoints whose group served were predicted (and learned from) as swapped out."""
    source = Groups(
        {
            "gp": GroupStatus("LOCKED", "inference", "inference", 0, 0.0),
            "gd": GroupStatus("LOCKED", "training", "training", 1, 0.0),
        }
    )
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    candidates = [cand("p0", role="prefill", group="gp"), cand("d0", role="decode", group="gd")]
    policy.pick(req(at=1000.0), candidates)
    states = {(r.endpoint.endpoint_id, r.endpoint.timeslice_state) for r in model.asked[-1]}
    assert states == {("p0", "resident"), ("d0", "parked")}


def test_prefix_hits_are_dropped_after_a_swap() -> None:
    source = Groups({"rl": GroupStatus("LOCKED", "training", "training", 1, 0.0)})
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    policy.pick(req(at=100.0), [cand("x", group="rl", hits=800), cand("y")])
    source.statuses["rl"] = GroupStatus("LOCKED", "inference", "inference", 0, 5_000.0)
    # Published at 4 s, before the swap back at 5 s: the 800 cached tokens it reports are gone.
    policy.pick(req("r2", at=5_010.0), [cand("x", group="rl", hits=800, published_ms=4_000.0)])
    assert model.asked[-1][0].request.prefix_hit_tokens == 0
    policy.pick(req("r3", at=5_100.0), [cand("x", group="rl", hits=800, published_ms=5_050.0)])
    assert model.asked[-1][0].request.prefix_hit_tokens == 800


def test_the_residency_tracker_learns_away_and_restore_times() -> None:
    tracker = ResidencyTracker("inference", prior_away_ms=5000.0)
    assert tracker.expected_wait_ms("g", 0.0) == 0.0  # never seen: assumed serving
    tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, 0.0), 0.0)
    assert tracker.expected_wait_ms("g", 1000.0) == pytest.approx(4000.0 + 100.0)  # the priors
    for start in (10_000.0, 20_000.0):
        tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, start), start)
        tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, start + 50.0), start + 50.0)
        tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, start + 5000.0), start + 5000.0)
    assert tracker.serving("g") is False
    # Away periods of 10 s and 5 s seen; 6 s into this one only the 10 s one is longer: 4 s left, + 50 ms.
    assert tracker.expected_wait_ms("g", 31_000.0) == pytest.approx(4050.0)
    assert tracker.swapped_in_at("g") == 0.0  # not serving now


def test_a_switch_away_from_serving_counts_as_away_not_as_a_restore() -> None:
    """Regression: an orchestrator reports SWITCHING on the way out too; it was taken for a swap-in, so all through
    the other job's turn the group was expected back at once (wait 0), and the turn was learned as a restore."""
    tracker = ResidencyTracker("inference", prior_away_ms=5000.0, prior_restore_ms=100.0)
    tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, 0.0), 0.0)
    tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, 60_000.0), 60_000.0)
    assert tracker.expected_wait_ms("g", 60_100.0) == pytest.approx(4900.0 + 100.0)  # the priors, not a restore
    tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, 60_200.0), 60_200.0)
    assert tracker.expected_wait_ms("g", 61_000.0) == pytest.approx(4000.0 + 100.0)
    tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, 80_000.0), 80_000.0)
    tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, 80_000.0), 80_100.0)  # looked again
    tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, 80_300.0), 80_300.0)
    # Away from the switch out (60 s) to the switch in (80 s); restoring 300 ms.
    assert tracker.expected_wait_ms("g", 80_400.0) == 0.0
    tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, 140_000.0), 140_000.0)
    tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, 140_200.0), 140_200.0)
    assert tracker.expected_wait_ms("g", 145_000.0) == pytest.approx(15_000.0 + 300.0)
    assert tracker.expected_wait_ms("g", 165_000.0) == pytest.approx(20_000.0 + 300.0)  # outlasted: one more mean


def test_a_group_first_seen_restoring_learns_its_restore_but_no_away_period() -> None:
    """Regression: a router started while a group was swapping back in learned an away period of 0 ms (when it went
    away was never seen), which replaced the prior: the next swap-out was expected over after the restore alone."""
    tracker = ResidencyTracker("inference", prior_away_ms=5000.0)
    tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, 1000.0), 1000.0)
    tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, 1100.0), 1100.0)
    assert tracker.away_overlap_ms("g", 0.0, 2000.0) == pytest.approx(100.0)  # the restore seen is away time
    tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, 60_000.0), 60_000.0)
    assert tracker.expected_wait_ms("g", 60_000.0) == pytest.approx(5000.0 + 100.0)  # the prior, the restore seen


def test_swap_out_risk_grows_with_the_work_and_away_time_is_taken_out_of_what_is_learned() -> None:
    tracker = ResidencyTracker("inference")
    for start in (0.0, 10_000.0, 20_000.0):  # resident 8 s, away 1.9 s, restoring 0.1 s, three times
        tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, start), start)
        tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, start + 8000.0), start + 8000.0)
        tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, start + 9900.0), start + 9900.0)
    tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, 30_000.0), 30_000.0)
    short, long, queued = tracker.swap_risk_ms("g", np.array([100.0, 8000.0, 600_000.0]))
    assert tracker.swap_risk_factor("g") == pytest.approx(1 + 2000.0 / 8000.0)
    assert short == pytest.approx(125.0)  # 0.1 s of work meets 1/80 of a swap-out, costing 2 s
    assert long == pytest.approx(10_000.0)  # a resident period's work meets one
    assert queued == pytest.approx(750_000.0)  # 10 minutes in an overloaded queue: 75 swap-outs, not e^75
    assert tracker.away_overlap_ms("g", 7000.0, 12_000.0) == pytest.approx(2000.0)
    assert tracker.away_overlap_ms("g", 0.0, 7000.0) == 0.0
    assert tracker.swap_risk_ms("never-seen", np.array([500.0])).tolist() == [500.0]


def test_a_request_that_waited_out_a_swap_teaches_the_endpoint_speed_without_the_wait() -> None:
    source = Groups({"g": GroupStatus("LOCKED", "inference", "inference", 0, 0.0)})
    model = QueueModel()
    policy = LeadtimePolicy(model, LeadtimeConfig(exploration=0.0), timeslice_source=source)
    policy.pick(req("r", at=1000.0), [cand("s", group="g")])
    source.statuses["g"] = GroupStatus("LOCKED", "training", "training", 1, 1100.0)
    policy.pick(req("r2", at=1200.0), [cand("s", group="g"), cand("d")])
    source.statuses["g"] = GroupStatus("LOCKED", "inference", "inference", 0, 4100.0)
    policy.pick(req("r3", at=4200.0), [cand("s", group="g"), cand("d")])
    # r arrived at 1.0 s, its group was away 1.1-4.1 s, its first token came at 4.3 s: 300 ms of its own.
    policy.observe(Outcome("r", "s", None, ttft_ms=3300.0, itl_ms=20.0, output_tokens=10, completed_ms=4480.0))
    learned = next(o for o in model.told if o.row.endpoint.endpoint_id == "s")
    assert learned.actual_ttft_ms == pytest.approx(300.0)
    blind = LeadtimePolicy(QueueModel(), LeadtimeConfig(timeslice=False, exploration=0.0), timeslice_source=source)
    blind.pick(req("r", at=1000.0), [cand("s", group="g")])
    blind.observe(Outcome("r", "s", None, ttft_ms=3300.0, itl_ms=20.0, output_tokens=10, completed_ms=4480.0))
    assert blind.predictor.told[0].actual_ttft_ms == 3300.0  # type: ignore[attr-defined]


def test_a_parked_endpoints_stated_wait_counts_until_the_router_has_learned_the_group() -> None:
    """Without a time-slice source, a candidate parked for 5 s (its state says so) was scored as if it had no wait
    because it named a group the router knew nothing of, and it took the request from an endpoint 50 deep."""
    policy = LeadtimePolicy(InProcessPredictor(OnlinePredictor(LearnerConfig(background=False))), LeadtimeConfig())
    parked = Candidate(EndpointState("x", timeslice_state="parked", timeslice_wait_ms=5000.0), timeslice_group="g")
    busy = Candidate(EndpointState("y", num_request_waiting=50))
    pick = policy.pick(RouteRequest("r", 100, ttft_slo_ms=300.0, tpot_slo_ms=40.0), [parked, busy])
    assert pick.endpoint_id == "y"
    scored = policy._state(parked, away=True, now_ms=0.0)
    assert scored.timeslice_wait_ms == 5000.0


def test_endpoints_that_left_are_forgotten_even_when_their_last_requests_complete_later() -> None:
    """Regression: when each endpoint was last sent a request and last heard from was kept for every endpoint id
    ever seen: with Kubernetes pod names, 1,000 entries after 500 rollouts of a 2-pod deployment."""
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig(exploration=0.0, comfort_tolerance=0.1))
    for rollout in range(50):
        pods = [cand(f"vllm-{rollout}-{k}") for k in range(2)]
        for j in range(4):
            rid = f"r{rollout}-{j}"
            pick = policy.pick(req(rid, at=rollout * 10.0 + j), pods)
            if j < 3:
                policy.observe(Outcome(rid, pick.endpoint_id, None, 100.0, 10.0, 20, rollout * 10.0 + j + 1))
        for pod in pods:
            policy.forget_endpoint(pod.endpoint_id)
        # The last request of the rollout completes after its endpoint left the fleet.
        policy.observe(Outcome(f"r{rollout}-3", pick.endpoint_id, None, 100.0, 10.0, 20, rollout * 10.0 + 9))
    assert policy._last_sent == {} and policy._last_heard == {}


def test_picks_never_reported_do_not_grow_the_policy_without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 picks without an outcome or an abandon left 20,000 decisions held; a decision forgotten so stayed in
    the ledgers for good, in flight and weighing its ITL SLO on its endpoint's score."""
    from leadtime.router_plugin import predicted

    monkeypatch.setattr(predicted, "MAX_OPEN_DECISIONS", 50)
    policy = LeadtimePolicy(InProcessPredictor(OnlinePredictor(LearnerConfig(background=False))), LeadtimeConfig())
    candidates = [Candidate(EndpointState("a")), Candidate(EndpointState("b"))]
    for i in range(120):
        policy.pick(RouteRequest(f"r{i}", 100, ttft_slo_ms=1000.0, tpot_slo_ms=50.0), candidates)
    assert len(policy._decisions) == 50 and "r119" in policy._decisions and "r0" not in policy._decisions
    assert len(policy.ledgers.inflight) == len(policy.ledgers.decoding) == 50


def test_a_request_decided_again_is_the_newest_open_decision_not_the_first_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry decided again kept its first place in the order, and was forgotten (and let go of in the ledgers)
    first, while in flight."""
    from leadtime.router_plugin import predicted

    monkeypatch.setattr(predicted, "MAX_OPEN_DECISIONS", 3)
    policy = LeadtimePolicy(QueueModel(), LeadtimeConfig())
    for rid in ("r0", "r1", "r2", "r0", "r3"):
        policy.pick(req(rid), [cand("a"), cand("b")])
    assert list(policy._decisions) == ["r2", "r0", "r3"] and len(policy.ledgers.inflight) == 3
