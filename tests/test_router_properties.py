"""Property-based tests (hypothesis) of the routing policies used as a library: random sequences of picks over
changing candidate sets (unified, P/D, time-sliced groups, several accelerator classes, endpoints coming and going),
outcomes in any order, abandons, first tokens, repeated and unknown request ids, and extreme but valid values.

For every policy (Leadtime's over a learner and over a stub answering anything up to `MAX_PREDICTED_MS`, llm-d's
predicted-latency peer, Dynamo's and SGLang's, the heuristics, shadow mode):

- nothing escapes but NoCandidateError, and that only for a fleet that cannot serve a client;
- a pick names candidates it was offered (on P/D a prefill and a decode endpoint), and what it predicts is finite
  and within `MAX_PREDICTED_MS`;
- `observe` of an outcome of a request it picked never raises;
- once every request picked has been observed or abandoned, nothing counts in flight anywhere.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from property_search import SEARCH

from leadtime.features.rows import MAX_COUNT, MAX_PREDICTED_MS, EndpointState, FeatureRow, Observation
from leadtime.predictor.client import BulkPredictions, PredictorError, PredictorUnavailable
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.router_plugin.client import InProcessPredictor
from leadtime.router_plugin.config import SHIPPED_CONFIG, build_policy
from leadtime.router_plugin.heuristics import LeastQueuePolicy, LlmdHeuristicPolicy, RandomPolicy, RoundRobinPolicy
from leadtime.router_plugin.peers.dynamo_kv import DynamoKvPolicy
from leadtime.router_plugin.peers.llmd_predicted import LlmdPredictedPolicy
from leadtime.router_plugin.peers.sglang_cache import SglangCachePolicy
from leadtime.router_plugin.policy import (
    MIN_SLO_MS,
    Candidate,
    NoCandidateError,
    Outcome,
    Pick,
    RouteRequest,
    candidates_that_fit,
    serves_clients,
)
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy
from leadtime.router_plugin.shadow import ShadowLearning
from leadtime.router_plugin.timeslice import GROUP_STATES, OTHER_JOB, SERVING_JOB, GroupStatus

PROPERTY = settings(SEARCH, max_examples=100)

ACCELERATORS = ("h100-sxm", "l40s", "mi300x", "tpu-v5e", "")
MODELS = ("llama-3.1-8b", "qwen3-32b", "")
GROUPS = ("g0", "g1")
ENDPOINTS = tuple(f"e{i}" for i in range(6))
Draw = Callable[..., Any]
"""`st.DataObject.draw`: a strategy in, an example out."""
REQUEST_IDS = tuple(f"r{i}" for i in range(12))  # few: ids repeat


# ----------------------------------------------------------------------------------------------- stand-ins


class StubPredictor:
    """A `PredictorClient` answering anything a predictor may: 0, tiny, huge, `MAX_PREDICTED_MS`, quantiles below
    their means; now and then it fails (unreachable, or refusing the rows) as a remote one may."""

    def __init__(self, seed: int, failing: bool) -> None:
        self._rng = random.Random(seed)
        self.failing = failing

    def _value(self) -> float:
        r = self._rng
        return r.choice(
            (0.0, 1e-9, 1.0, 50.0, 1e6, MAX_PREDICTED_MS, MAX_PREDICTED_MS * 0.999, -1.0, r.uniform(0, 1e4))
        )

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        if self.failing and self._rng.random() < 0.2:
            raise self._rng.choice((PredictorUnavailable(503, "down"), PredictorError("invalid", "refused")))
        ttft, ttft_q, tpot, tpot_q = (np.array([self._value() for _ in rows]) for _ in range(4))
        return BulkPredictions(ttft, ttft_q, tpot, tpot_q, 1, 0.9)

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        if self.failing and self._rng.random() < 0.2:
            raise PredictorUnavailable(503, "down")
        return len(observations)


@dataclass
class _LlmdPredictions:
    ttft_mean: np.ndarray
    ttft_quantile: np.ndarray
    tpot_mean: np.ndarray
    tpot_quantile: np.ndarray


class StubLlmdModel:
    """llm-d's predictor as `LlmdPredictedPolicy` sees it, answering anything up to `MAX_PREDICTED_MS`."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.learned = 0

    def predict_many(self, rows: Sequence[Any]) -> _LlmdPredictions:
        r = self._rng
        choices = (0.0, 1.0, 1e6, MAX_PREDICTED_MS)
        values = [np.array([r.choice((*choices, r.uniform(0, 1e4))) for _ in rows]) for _ in range(4)]
        return _LlmdPredictions(*values)

    def learn_many(self, rows: Sequence[Any]) -> None:
        self.learned += len(rows)

    def retrain(self) -> None:
        pass


class Orchestrator:
    """A time-slice source whose groups change as the test says (None: a group it does not know)."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupStatus | None] = {}

    def status(self, group: str) -> GroupStatus | None:
        return self.groups.get(group)


# ----------------------------------------------------------------------------------------------- policies


@dataclass
class Subject:
    """A policy under test and how to read what it counts in flight."""

    policy: Any
    in_flight: Callable[[], dict[str, object]]
    orchestrator: Orchestrator = field(default_factory=Orchestrator)


def _leadtime_in_flight(policy: LeadtimePolicy) -> dict[str, object]:
    ledgers = policy.ledgers
    return {
        "inflight": len(ledgers.inflight),
        "inflight endpoints": len(ledgers.inflight._endpoints),
        "decoding": len(ledgers.decoding),
        "decoding endpoints": len(ledgers.decoding._endpoints),
        "decisions": len(policy._decisions),
    }


def _llmd_in_flight(policy: LlmdPredictedPolicy) -> dict[str, object]:
    c = policy._counters
    return {
        "prefill": {k: v for k, v in c.prefill.items() if v},
        "decode": {k: v for k, v in c.decode.items() if v},
        "routed": len(c.routed),
        "decisions": len(policy._decisions),
    }


def _dynamo_in_flight(policy: DynamoKvPolicy) -> dict[str, object]:
    return {
        "active blocks": {e: policy.active_blocks(e) for e in ENDPOINTS if policy.active_blocks(e)},
        "routed": len(policy._routed),
    }


def _sglang_in_flight(policy: SglangCachePolicy) -> dict[str, object]:
    return {"load": {e: policy.load(e) for e in ENDPOINTS if policy.load(e)}, "routed": len(policy._routed)}


def _nothing(policy: object) -> dict[str, object]:
    return {}


IN_FLIGHT: dict[type, Callable[[Any], dict[str, object]]] = {
    LeadtimePolicy: _leadtime_in_flight,
    LlmdPredictedPolicy: _llmd_in_flight,
    DynamoKvPolicy: _dynamo_in_flight,
    SglangCachePolicy: _sglang_in_flight,
}


def _in_flight_of(policy: Any) -> Callable[[], dict[str, object]]:
    if isinstance(policy, ShadowLearning):
        baseline = _in_flight_of(policy.baseline)
        return lambda: {"shadowed": len(policy._decisions), **baseline()}
    read = IN_FLIGHT.get(type(policy), _nothing)
    return lambda: read(policy)


def _baseline(kind: str, seed: int) -> Any:
    return {
        "round_robin": RoundRobinPolicy,
        "random": lambda: RandomPolicy(seed),
        "least_queue": lambda: LeastQueuePolicy(seed),
        "llmd_heuristic": lambda: LlmdHeuristicPolicy(seed=seed),
        "llmd_heuristic_ready": lambda: LlmdHeuristicPolicy(seed=seed, ready_only=True),
        "dynamo_kv": lambda: DynamoKvPolicy(seed=seed),
        "dynamo_kv_local": lambda: DynamoKvPolicy(seed=seed, max_local_prefill_tokens=64),
        "sglang_cache": lambda: SglangCachePolicy(seed=seed),
        "sglang_cache_small": lambda: SglangCachePolicy(seed=seed, max_tree_tokens=1000, balance_abs_threshold=1),
    }[kind]()


PLAIN = (
    "round_robin",
    "random",
    "least_queue",
    "llmd_heuristic",
    "llmd_heuristic_ready",
    "dynamo_kv",
    "dynamo_kv_local",
    "sglang_cache",
    "sglang_cache_small",
)
LEADTIME_CONFIGS = {
    "default": LeadtimeConfig(),
    "llmd_order": LeadtimeConfig(joint_pairs=False),
    "explore_hold": LeadtimeConfig(exploration=0.5, hold_slo_multiple=3.0, overload_window=1, overflow_cap_share=0.0),
    "tolerant": LeadtimeConfig(comfort_tolerance=0.5, fit="tightest", overflow="sink", overflow_endpoints=("e2", "e0")),
    "blind": LeadtimeConfig(hardware=False, timeslice=False, inflight=False, decode_harm=False),
}


def make_subject(kind: str, config: str, seed: int) -> Subject:
    orchestrator = Orchestrator()
    policy: Any
    if kind == "leadtime_learner":
        learner = OnlinePredictor(LearnerConfig(background=False, retrain_every=40, min_window=50, tree_rounds=5))
        policy = LeadtimePolicy(InProcessPredictor(learner), LEADTIME_CONFIGS[config], orchestrator)
    elif kind in ("leadtime_stub", "leadtime_failing"):
        stub = StubPredictor(seed, failing=kind == "leadtime_failing")
        policy = LeadtimePolicy(stub, LEADTIME_CONFIGS[config], orchestrator)
    elif kind == "leadtime_profile":  # the shipped plugin configuration: heuristic scorers beside the latency one
        policy = build_policy(SHIPPED_CONFIG, StubPredictor(seed, failing=True), seed=seed)
        policy.timeslice_source = orchestrator
    elif kind == "llmd_predicted":
        policy = LlmdPredictedPolicy(StubLlmdModel(seed), retrain_every_ms=100.0, seed=seed)
    elif kind == "shadow":
        policy = ShadowLearning(_baseline(PLAIN[seed % len(PLAIN)], seed), StubPredictor(seed, failing=seed % 2 == 1))
    else:
        policy = _baseline(kind, seed)
    return Subject(policy, _in_flight_of(policy), orchestrator)


# ----------------------------------------------------------------------------------------------- strategies

counts = st.one_of(st.integers(0, 64), st.sampled_from((0, MAX_COUNT)), st.integers(0, MAX_COUNT))
slos = st.one_of(st.none(), st.sampled_from((MIN_SLO_MS, 1e12, math.inf, 50.0, 2000.0)), st.floats(MIN_SLO_MS, 1e6))


@st.composite
def endpoint_states(draw: st.DrawFn, endpoint_id: str, role: str, accelerator: str, model: str) -> EndpointState:
    return EndpointState(
        endpoint_id=endpoint_id,
        accelerator=accelerator,
        model=model,
        tensor_parallel=draw(st.sampled_from((1, 2, 8))),
        role=role,
        num_request_waiting=draw(counts),
        num_request_running=draw(counts),
        kv_cache_percentage=draw(st.sampled_from((0.0, 0.5, 1.0))),
        prefill_tokens_in_flight=draw(counts),
        decode_tokens_in_flight=draw(counts),
        timeslice_state=draw(st.sampled_from(("none", "resident", "switching", "parked"))),
        timeslice_wait_ms=draw(st.sampled_from((0.0, 100.0, 1e9, 1e300))),
    )


@dataclass(frozen=True)
class Fleet:
    """Fixed per example: each endpoint's role, class, model and time-slice group."""

    roles: dict[str, str]
    accelerators: dict[str, str]
    models: dict[str, str]
    groups: dict[str, str]


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    pd = draw(st.booleans())
    roles = {e: (draw(st.sampled_from(("prefill", "decode"))) if pd else "both") for e in ENDPOINTS}
    return Fleet(
        roles,
        {e: draw(st.sampled_from(ACCELERATORS)) for e in ENDPOINTS},
        {e: draw(st.sampled_from(MODELS)) for e in ENDPOINTS},
        {e: draw(st.sampled_from(("", "", *GROUPS))) for e in ENDPOINTS},
    )


def draw_candidates(draw: Draw, fleet: Fleet, now: float) -> list[Candidate]:
    offered = draw(st.lists(st.sampled_from(ENDPOINTS), unique=True, max_size=len(ENDPOINTS)))
    out = []
    for e in offered:
        state = draw(endpoint_states(e, fleet.roles[e], fleet.accelerators[e], fleet.models[e]))
        input_hits = draw(st.one_of(st.just(0), counts))
        published = now - draw(st.sampled_from((0.0, 1.0, 500.0, -1.0, 1e6)))
        kv_cache = draw(st.one_of(st.none(), counts))
        out.append(Candidate(state, input_hits, published, fleet.groups[e], kv_cache))
    return out


def draw_request(draw: Draw, request_id: str, now: float) -> RouteRequest:
    tokens = draw(st.one_of(st.integers(0, 5000), st.sampled_from((0, 1, MAX_COUNT))))
    hashes = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    return RouteRequest(
        request_id,
        tokens,
        hashes,
        draw(slos),
        draw(slos),
        arrival_ms=now,
        held_ms=draw(st.sampled_from((0.0, 0.0, 10.0, 1e6))),
        max_output_tokens=draw(st.one_of(st.none(), counts)),
    )


def draw_outcome(draw: Draw, request_id: str, pick: Pick, now: float) -> Outcome:
    return Outcome(
        request_id,
        pick.endpoint_id,
        pick.decode_endpoint_id,
        ttft_ms=draw(st.one_of(st.sampled_from((0.0, 1e-9, 1e12, 1e300)), st.floats(0, 1e5))),
        itl_ms=draw(st.one_of(st.sampled_from((0.0, 1e-9, 1e12)), st.floats(0, 1e3))),
        output_tokens=draw(st.one_of(st.sampled_from((0, 1, 2, MAX_COUNT)), st.integers(0, 2000))),
        completed_ms=now + draw(st.sampled_from((0.0, 1.0, -1.0, 1e4))),
    )


# ----------------------------------------------------------------------------------------------- the walk


def check_pick(pick: Pick, candidates: Sequence[Candidate]) -> None:
    """The pick names candidates offered, in their roles, and predicts finite values within the bound."""
    roles = {c.endpoint_id: c.state.role for c in candidates}
    if pick.hold:
        return
    assert pick.endpoint_id in roles, (pick, sorted(roles))
    if pick.decode_endpoint_id is not None:
        assert pick.decode_endpoint_id in roles, (pick, sorted(roles))
        if pick.decode_endpoint_id != pick.endpoint_id:
            assert roles[pick.endpoint_id] == "prefill" and roles[pick.decode_endpoint_id] == "decode", pick
    else:
        assert roles[pick.endpoint_id] != "prefill", pick
    for value in (pick.predicted_ttft_ms, pick.predicted_tpot_ms):
        if value is not None:
            assert math.isfinite(value) and value <= MAX_PREDICTED_MS, pick


OPERATIONS = ("pick", "pick", "pick", "observe", "abandon", "prefilled", "time", "group", "forget")


def walk(draw: Draw, subject: Subject, fleet: Fleet, steps: int, repeat_ids: bool = True) -> None:
    """`steps` random operations on `subject`, then every request picked completes or is given up. `repeat_ids`:
    a request id may be picked again before its outcome (a retry), else each pick has its own."""
    policy = subject.policy
    now = draw(st.sampled_from((1000.0, 0.0, -1e6, 1e15)))
    fresh = (f"n{i}" for i in range(steps))
    open_picks: dict[str, Pick] = {}  # picked and not yet observed or abandoned
    for _ in range(steps):
        op = draw(st.sampled_from(OPERATIONS))
        if op == "time":
            now += draw(st.sampled_from((0.0, 0.0, -1.0, 1.0, 250.0, 1e5)))  # bursts, a step back, long gaps
        elif op == "group":
            group = draw(st.sampled_from(GROUPS))
            status = draw(
                st.none()
                | st.builds(
                    GroupStatus,
                    st.sampled_from(GROUP_STATES),
                    st.sampled_from((SERVING_JOB, OTHER_JOB, "")),
                    st.sampled_from((SERVING_JOB, OTHER_JOB, "")),
                    st.integers(0, 3),
                    st.just(now) | st.sampled_from((0.0, now - 10.0, now + 10.0)),
                )
            )
            subject.orchestrator.groups[group] = status
        elif op == "forget":
            if hasattr(policy, "forget_endpoint"):
                policy.forget_endpoint(draw(st.sampled_from(ENDPOINTS)))
        elif op == "pick":
            request_id = draw(st.sampled_from(REQUEST_IDS)) if repeat_ids else next(fresh)
            request = draw_request(draw, request_id, now)
            offered = draw_candidates(draw, fleet, now)
            try:
                candidates = candidates_that_fit(request, offered)  # as a router offers them
                pick = policy.pick(request, candidates)
            except NoCandidateError:
                fit = [c for c in offered if c.holds(request)]
                assert not serves_clients(fit), [c.state for c in offered]
                continue
            check_pick(pick, candidates)
            if not pick.hold:
                open_picks[request_id] = pick
        elif op in ("observe", "abandon", "prefilled"):
            known = sorted(open_picks)
            request_id = draw(st.sampled_from(known) if known and draw(st.booleans()) else st.sampled_from(REQUEST_IDS))
            pick = open_picks.get(request_id, Pick(ENDPOINTS[0]))
            if op == "prefilled":
                if hasattr(policy, "prefilled"):
                    policy.prefilled(request_id, now)
                continue
            if op == "observe":
                policy.observe(draw_outcome(draw, request_id, pick, now))
            elif hasattr(policy, "abandon"):
                policy.abandon(request_id)
            else:
                continue
            open_picks.pop(request_id, None)
    # Every request picked completes or is given up, in any order.
    for request_id in draw(st.permutations(sorted(open_picks))):
        if draw(st.booleans()) or not hasattr(policy, "abandon"):
            if draw(st.booleans()) and hasattr(policy, "prefilled"):
                policy.prefilled(request_id, now)
            policy.observe(draw_outcome(draw, request_id, open_picks[request_id], now))
        else:
            policy.abandon(request_id)
    left = {k: v for k, v in subject.in_flight().items() if v}
    assert not left, (type(policy).__name__, left)


KINDS = ("leadtime_stub", "leadtime_failing", "leadtime_profile", "llmd_predicted", "shadow", *PLAIN)


@PROPERTY
@given(st.data(), st.sampled_from(KINDS), st.sampled_from(sorted(LEADTIME_CONFIGS)), st.integers(0, 7), fleets())
def test_every_policy_keeps_its_contract_over_random_operations(
    data: st.DataObject, kind: str, config: str, seed: int, fleet: Fleet
) -> None:
    """Found: Leadtime's pick raising FeatureError past MAX_COUNT in flight, Dynamo's active blocks left by rounding,
    and every peer's counts of a request picked again under its id kept for ever."""
    walk(data.draw, make_subject(kind, config, seed), fleet, steps=30, repeat_ids=data.draw(st.booleans()))


@settings(PROPERTY, max_examples=15)
@given(st.data(), st.sampled_from(sorted(LEADTIME_CONFIGS)), st.integers(0, 7), fleets())
def test_leadtime_over_a_learner_keeps_its_contract_over_random_operations(
    data: st.DataObject, config: str, seed: int, fleet: Fleet
) -> None:
    """The same walk over a real (small, cold) learner: what it predicts and learns is the policy's own."""
    subject = make_subject("leadtime_learner", config, seed)
    walk(data.draw, subject, fleet, steps=30, repeat_ids=data.draw(st.booleans()))
