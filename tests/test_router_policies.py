"""The routing-policy protocol and the heuristic policies (Filter → Scorer → Picker)."""

from __future__ import annotations

from collections import Counter

import pytest

from leadtime.features.errors import FeatureError
from leadtime.features.rows import EndpointState
from leadtime.router_plugin.heuristics import (
    LeastQueuePolicy,
    LlmdHeuristicPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    kv_utilization_scorer,
    prefix_cache_scorer,
    queue_scorer,
    resident_filter,
)
from leadtime.router_plugin.policy import (
    Candidate,
    NoCandidateError,
    Pick,
    RouteRequest,
    RoutingPolicy,
    candidates_that_fit,
    split_by_role,
)


def cand(
    name: str,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    hits: int = 0,
    role: str = "both",
    timeslice: str = "none",
) -> Candidate:
    state = EndpointState(
        endpoint_id=name,
        role=role,
        num_request_waiting=waiting,
        num_request_running=running,
        kv_cache_percentage=kv,
        timeslice_state=timeslice,
    )
    return Candidate(state, hits)


REQ = RouteRequest("r1", input_tokens=1000)


def test_every_policy_satisfies_the_protocol() -> None:
    cands = [cand("a", waiting=0, kv=0.1), cand("b", waiting=6, kv=0.9)]
    for policy in (RandomPolicy(), RoundRobinPolicy(), LeastQueuePolicy(), LlmdHeuristicPolicy()):
        assert isinstance(policy, RoutingPolicy)
        assert isinstance(policy.name, str) and policy.name
        # Its decision: one of the candidates, and no P/D pair among unified endpoints.
        pick = policy.pick(REQ, cands)
        assert pick.endpoint_id in ("a", "b") and pick.decode_endpoint_id is None, (policy.name, pick)
        if isinstance(policy, LeastQueuePolicy | LlmdHeuristicPolicy):  # those that look at load: the idle one
            assert pick.endpoint_id == "a", (policy.name, pick)


def test_scorers_are_in_unit_interval() -> None:
    cands = [cand("a", waiting=0, kv=0.2, hits=500), cand("b", waiting=4, kv=0.9, hits=0), cand("c", waiting=2)]
    for scorer in (prefix_cache_scorer, queue_scorer, kv_utilization_scorer):
        scores = scorer(REQ, cands)
        assert len(scores) == 3 and all(0.0 <= s <= 1.0 for s in scores)
    assert prefix_cache_scorer(REQ, cands) == [0.5, 0.0, 0.0]
    assert queue_scorer(REQ, cands) == [1.0, 0.0, 0.5]
    assert queue_scorer(REQ, [cand("x", waiting=3), cand("y", waiting=3)]) == [1.0, 1.0]
    assert kv_utilization_scorer(REQ, cands) == pytest.approx([0.8, 0.1, 1.0])


def test_llmd_weights_prefix_three_queue_two_kv_two() -> None:
    b = cand("b", waiting=0, kv=0.0, hits=0)  # 3·0 + 2·1 + 2·1 = 4
    a = cand("a", waiting=5, kv=0.4, hits=1000)  # 3·1 + 2·0 + 2·0.6 = 4.2
    assert LlmdHeuristicPolicy().pick(REQ, [a, b]) == Pick("a")
    a2 = cand("a", waiting=5, kv=0.6, hits=1000)  # 3 + 0 + 0.8 = 3.8
    assert LlmdHeuristicPolicy().pick(REQ, [a2, b]) == Pick("b")
    assert LlmdHeuristicPolicy(prefix_weight=10).pick(REQ, [a2, b]) == Pick("a")


def test_ties_are_broken_at_random_but_reproducibly() -> None:
    cands = [cand(n) for n in "abcd"]
    picks = [LlmdHeuristicPolicy(seed=1).pick(REQ, cands).endpoint_id for _ in range(1)]
    policy = LlmdHeuristicPolicy(seed=1)
    many = Counter(policy.pick(REQ, cands).endpoint_id for _ in range(400))
    assert set(many) == set("abcd")
    again = LlmdHeuristicPolicy(seed=1)
    assert [again.pick(REQ, cands).endpoint_id for _ in range(1)] == picks


def test_round_robin_cycles_and_random_covers() -> None:
    cands = [cand(n) for n in "abc"]
    rr = RoundRobinPolicy()
    assert [rr.pick(REQ, cands).endpoint_id for _ in range(6)] == list("abcabc")
    rnd = RandomPolicy(seed=3)
    assert set(rnd.pick(REQ, cands).endpoint_id for _ in range(100)) == set("abc")


def test_least_queue_counts_waiting_and_running() -> None:
    cands = [cand("a", waiting=1, running=5), cand("b", waiting=3, running=0), cand("c", waiting=2, running=2)]
    assert LeastQueuePolicy().pick(REQ, cands) == Pick("b")


def test_pd_fleets_get_pairs() -> None:
    cands = [
        cand("p0", role="prefill", waiting=3),
        cand("p1", role="prefill"),
        cand("d0", role="decode"),
        cand("d1", role="decode", waiting=4),
    ]
    for policy in (RandomPolicy(), RoundRobinPolicy(), LeastQueuePolicy(), LlmdHeuristicPolicy()):
        pick = policy.pick(REQ, cands)
        assert pick.is_pair
        assert pick.endpoint_id in ("p0", "p1") and pick.decode_endpoint_id in ("d0", "d1")
    assert LlmdHeuristicPolicy().pick(REQ, cands) == Pick("p1", "d0")


def test_split_by_role_errors() -> None:
    with pytest.raises(NoCandidateError):
        split_by_role([])
    with pytest.raises(NoCandidateError, match="no decode"):
        split_by_role([cand("p", role="prefill")])
    assert not split_by_role([cand("a")]).disaggregated


def test_decode_endpoints_without_a_prefill_endpoint_serve_requests_whole() -> None:
    """A P/D fleet whose prefill pool is gone (scaled to zero, unreachable) was a 503 for every request, though
    its decode endpoints prefill for themselves whatever is not sent elsewhere."""
    split = split_by_role([cand("d0", role="decode"), cand("d1", role="decode", waiting=3)])
    assert [c.endpoint_id for c in split.unified] == ["d0", "d1"] and not split.disaggregated
    cands = [cand("d0", role="decode", waiting=2), cand("d1", role="decode")]
    for policy in (RandomPolicy(), RoundRobinPolicy(), LeastQueuePolicy(), LlmdHeuristicPolicy()):
        pick = policy.pick(REQ, cands)
        assert not pick.is_pair and pick.endpoint_id in ("d0", "d1")


def test_resident_filter_drops_parked_unless_all_are() -> None:
    cands = [cand("a", timeslice="parked"), cand("b", timeslice="resident"), cand("c")]
    assert [c.endpoint_id for c in resident_filter(REQ, cands)] == ["b", "c"]
    parked = [cand("a", timeslice="parked")]
    assert resident_filter(REQ, parked) == parked


def test_candidate_row_carries_prefix_hits() -> None:
    row = cand("a", hits=400).row(REQ)
    assert row.request.prefix_hit_tokens == 400 and row.endpoint.endpoint_id == "a"
    assert cand("a", hits=5000).row(REQ).request.prefix_hit_tokens == 1000  # capped at the prompt


def test_only_candidates_whose_kv_cache_can_hold_the_request_are_offered() -> None:
    big = Candidate(EndpointState("big"), kv_cache_tokens=400_000)
    small = Candidate(EndpointState("small"), kv_cache_tokens=30_000)
    unpublished = Candidate(EndpointState("unpublished"))  # no cache size known: never left out
    ids = lambda cs: [c.endpoint_id for c in cs]  # noqa: E731
    request = RouteRequest("r", 29_000, max_output_tokens=2_000)  # prompt plus max_tokens: 31,000
    assert request.kv_tokens == 31_000
    assert ids(candidates_that_fit(request, [big, small, unpublished])) == ["big", "unpublished"]
    assert ids(candidates_that_fit(RouteRequest("r", 29_000), [big, small])) == ["big", "small"]  # prompt alone
    assert ids(candidates_that_fit(RouteRequest("r", 30_000), [small])) == ["small"]  # exactly full fits
    with pytest.raises(NoCandidateError, match=r"31,000 tokens \(prompt plus max_tokens\).*largest holds 30,000"):
        candidates_that_fit(request, [small])
    assert candidates_that_fit(request, []) == []  # no candidate at all is the policy's own refusal, as before


def test_a_pd_fleet_whose_decode_endpoints_cannot_hold_the_request_cannot_serve_it() -> None:
    prefill = Candidate(EndpointState("p", role="prefill"), kv_cache_tokens=400_000)
    decode = Candidate(EndpointState("d", role="decode"), kv_cache_tokens=10_000)
    with pytest.raises(NoCandidateError, match="KV cache"):
        candidates_that_fit(RouteRequest("r", 20_000), [prefill, decode])


def test_max_output_tokens_must_be_a_count() -> None:
    with pytest.raises(FeatureError, match="max_output_tokens"):
        RouteRequest("r", 10, max_output_tokens=-1)


def test_an_infinite_slo_is_no_slo() -> None:
    """An SLO of inf was kept as a number: the llm-d peer's headroom (inf − p) / inf was NaN, and its pick raised
    IndexError; the Leadtime policy took every candidate as equally inside it, rather than the fastest."""
    request = RouteRequest("r", 10, ttft_slo_ms=float("inf"), tpot_slo_ms=float("inf"))
    assert (request.ttft_slo_ms, request.tpot_slo_ms) == (None, None)
    assert RouteRequest("r", 10, ttft_slo_ms=float("inf"), tpot_slo_ms=50.0).ttft_slo_ms is None


@pytest.mark.parametrize("field", ["ttft_slo_ms", "tpot_slo_ms"])
def test_an_slo_below_a_microsecond_is_refused_naming_it(field: str) -> None:
    """`tpot_slo_ms=1e-320` was taken: 1 / SLO is infinite, and the in-flight ledger's sum of them turned NaN when
    the request completed, after which every pick offered its endpoint raised IndexError."""
    with pytest.raises(FeatureError, match=f"^{field}: must be a number of at least 0.001"):
        RouteRequest("r", 10, **{field: 1e-320})  # type: ignore[arg-type]
    assert getattr(RouteRequest("r", 10, **{field: 0.001}), field) == 0.001  # type: ignore[arg-type]
