"""The peer routers' rules on hand-made cases from their documentation: Dynamo's KV cost, SGLang's cache-aware
branches; and every peer's readiness behaviour on time-sliced fleets."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from leadtime.features.rows import MAX_COUNT, EndpointState
from leadtime.predictor.llmd_reference import LlmdReference
from leadtime.router_plugin.peers.dynamo_kv import DynamoKvPolicy
from leadtime.router_plugin.peers.llmd_predicted import LlmdPredictedPolicy
from leadtime.router_plugin.peers.sglang_cache import ApproximateTree, SglangCachePolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest, RoutingPolicy
from leadtime.simulator.learning_policies import LEADTIME_POLICIES, REPLICATED_POLICIES, SHADOW_POLICIES
from leadtime.simulator.run import POLICY_NAMES, make_policy


def cand(name: str, hits: int = 0, role: str = "both", timeslice: str = "none") -> Candidate:
    return Candidate(EndpointState(endpoint_id=name, role=role, timeslice_state=timeslice), hits)


def done(request_id: str, endpoint: str, decode: str | None = None) -> Outcome:
    return Outcome(request_id, endpoint, decode, ttft_ms=100.0, itl_ms=10.0, output_tokens=10, completed_ms=1.0)


# ------------------------------------------------------------------------------------------------ Dynamo


def test_dynamo_cost_is_overlap_weighted_prefill_blocks_plus_active_blocks() -> None:
    policy = DynamoKvPolicy(block_size=16)
    a, b = cand("a"), cand("b", hits=1600)
    # Nothing active: a computes 3200 tokens (200 blocks), b 1600 (100); both hold the request's 200 blocks.
    assert policy.costs(RouteRequest("r", 3200), [a, b]) == [400.0, 300.0]
    assert DynamoKvPolicy(overlap_score_weight=2.0).costs(RouteRequest("r", 3200), [a, b]) == [600.0, 400.0]
    assert policy.pick(RouteRequest("r1", 3200), [a, b]) == Pick("b")
    # b now carries r1's 200 blocks until r1 completes: the same request costs 400 on a, 500 on b.
    assert policy.active_blocks("b") == 200.0
    assert policy.costs(RouteRequest("r2", 3200), [a, b]) == [400.0, 500.0]
    assert policy.pick(RouteRequest("r2", 3200), [a, b]) == Pick("a")
    policy.observe(done("r1", "b"))
    assert policy.active_blocks("b") == 0.0
    assert policy.costs(RouteRequest("r3", 3200), [a, b]) == [600.0, 300.0]  # a has r2 active


def test_dynamo_counts_blocks_shared_by_active_sequences_once() -> None:
    policy = DynamoKvPolicy(block_size=16)
    a = cand("a")
    policy.pick(RouteRequest("r1", 1024, (1, 2)), [a])
    assert policy.active_blocks("a") == 64.0
    # r2 shares r1's first segment: only its second segment (512 tokens, 32 blocks) is new there.
    assert policy.costs(RouteRequest("r2", 1024, (1, 3)), [a]) == [64.0 + 64.0 + 32.0]
    policy.pick(RouteRequest("r2", 1024, (1, 3)), [a])
    assert policy.active_blocks("a") == 96.0
    policy.observe(done("r1", "a"))
    assert policy.active_blocks("a") == 64.0  # segment 1 is still r2's
    policy.observe(done("r2", "a"))
    assert policy.active_blocks("a") == 0.0


def test_dynamo_counts_nothing_on_a_worker_once_its_sequences_all_completed() -> None:
    """Its token sums were taken back by subtraction: prompts whose segments are not whole tokens left
    -2.2e-14 blocks active on an idle worker, and a prompt of MAX_COUNT tokens beside two of 3 left 0.125 (2 tokens
    lost to rounding at 2**53), counted in its cost for ever."""
    for sent in (
        (("r1", 1000, (1, 2, 3)), ("r2", 100, (4, 5, 6)), ("r3", 10, (7, 8, 9))),
        (("r1", MAX_COUNT, ()), ("r2", 3, ()), ("r3", 3, ())),
    ):
        policy = DynamoKvPolicy()
        for request_id, tokens, hashes in sent:
            policy.pick(RouteRequest(request_id, tokens, hashes), [cand("a")])
        for request_id, _, _ in sent:
            policy.observe(done(request_id, "a"))
        assert policy.active_blocks("a") == 0.0


def test_dynamo_breaks_ties_at_random_reproducibly() -> None:
    cands = [cand(n) for n in "abcd"]

    def picks(seed: int) -> list[str]:
        policy = DynamoKvPolicy(seed=seed)
        out = []
        for i in range(40):
            out.append(policy.pick(RouteRequest(str(i), 160), cands).endpoint_id)
            policy.observe(done(str(i), out[-1]))  # every worker idle again: all four tie each time
        return out

    assert set(picks(1)) == set("abcd") and picks(1) == picks(1)


def test_dynamo_pd_picks_a_pair_and_local_prefill_below_its_threshold() -> None:
    cands = [cand("p0", role="prefill"), cand("p1", role="prefill", hits=800), cand("d0", role="decode")]
    pick = DynamoKvPolicy().pick(RouteRequest("r", 1000), cands)
    assert pick == Pick("p1", "d0")
    conditional = DynamoKvPolicy(max_local_prefill_tokens=1000)
    assert conditional.pick(RouteRequest("short", 1000), cands) == Pick("d0")
    assert conditional.pick(RouteRequest("long", 1001), cands).is_pair


def test_dynamo_pd_frees_the_prefill_workers_sequence_once_its_prefill_is_done() -> None:
    """Dynamo's prefill router frees the sequence on the prefill worker when the prefill completes: only prefills
    in flight weigh on a prefill worker, while the decode worker holds the sequence until the request ends."""
    policy = DynamoKvPolicy(block_size=16)
    cands = [cand("p1", role="prefill"), cand("p2", role="prefill"), cand("d1", role="decode")]
    pick = policy.pick(RouteRequest("A", 8000, (11,)), cands)
    assert pick.decode_endpoint_id == "d1"
    prefill = pick.endpoint_id
    assert (policy.active_blocks(prefill), policy.active_blocks("d1")) == (500.0, 500.0)
    assert sorted(policy.costs(RouteRequest("B", 1600, (22,)), cands[:2])) == [200.0, 700.0]
    policy.prefilled("A", 10.0)
    assert (policy.active_blocks(prefill), policy.active_blocks("d1")) == (0.0, 500.0)
    # B, 1600 tokens (100 blocks), costs the same on both prefill workers again: 100 + 100 blocks.
    assert policy.costs(RouteRequest("B", 1600, (22,)), cands[:2]) == [200.0, 200.0]
    policy.observe(done("A", prefill, "d1"))
    assert policy.active_blocks("d1") == 0.0


def test_dynamo_unified_keeps_the_sequence_active_until_the_request_completes() -> None:
    policy = DynamoKvPolicy(block_size=16)
    policy.pick(RouteRequest("A", 1600), [cand("a")])
    policy.prefilled("A", 10.0)  # a unified worker decodes what it prefilled: the sequence is still active there
    assert policy.active_blocks("a") == 100.0
    policy.observe(done("A", "a"))
    assert policy.active_blocks("a") == 0.0


@pytest.mark.parametrize("first_token", [False, True], ids=["before", "after"])
def test_dynamo_releases_an_abandoned_request_as_a_completed_one(first_token: bool) -> None:
    """A request that fails is freed from the router's active sequences (Dynamo frees it on an error too)."""
    policy = DynamoKvPolicy(block_size=16)
    cands = [cand("p1", role="prefill"), cand("d1", role="decode")]
    policy.pick(RouteRequest("A", 1600, (1,)), cands)
    if first_token:
        policy.prefilled("A", 10.0)
    policy.abandon("A")
    assert (policy.active_blocks("p1"), policy.active_blocks("d1")) == (0.0, 0.0)
    policy.abandon("A")  # told twice, or of a request it never routed: nothing to release
    policy.abandon("never")
    policy.prefilled("never", 1.0)
    assert (policy.active_blocks("p1"), policy.active_blocks("d1")) == (0.0, 0.0)


# ------------------------------------------------------------------------------------------------ SGLang


def test_sglang_tree_matches_leading_hashes_and_evicts_least_recent() -> None:
    tree = ApproximateTree(max_tokens=3000)
    tree.insert(RouteRequest("a", 1024, (1, 2)))
    tree.insert(RouteRequest("b", 1024, (3, 4)))
    assert tree.matched((1, 2, 5)) == 2 and tree.matched((9, 1)) == 0
    tree.insert(RouteRequest("c", 1024, (5, 6)))  # 3072 tokens > 3000: the least recent entry goes,
    assert tree.tokens == 2560  # the tail of the oldest prompt: its head is still a usable prefix
    assert tree.matched((1, 2)) == 1 and tree.matched((3, 4)) == 2 and tree.matched((5, 6)) == 2


def _loaded(policy: SglangCachePolicy, endpoint: str, n: int, prefix: str) -> None:
    """Put `n` requests without shared prefixes in flight on `endpoint`."""
    for i in range(n):
        policy.pick(RouteRequest(f"{prefix}{i}", 512), [cand(endpoint)])


def test_sglang_balanced_fleet_routes_by_prefix_above_the_threshold() -> None:
    policy = SglangCachePolicy()
    a, b = cand("a"), cand("b")
    assert policy.pick(RouteRequest("warm", 2048, (1, 2, 3, 4)), [a]) == Pick("a")
    _loaded(policy, "a", 10, "x")  # a: 11 in flight, b: 0; max − min = 11 ≤ 64 → balanced
    assert policy.balanced([a, b])
    # 2 of 5 segments match on a (0.4 > 0.3): cache wins although a is the busier worker.
    assert policy.pick(RouteRequest("hit", 2560, (1, 2, 90, 91, 92)), [a, b]) == Pick("a")
    # 1 of 4 matches (0.25 ≤ 0.3): the worker with the smallest tree, b.
    assert policy.pick(RouteRequest("miss", 2048, (1, 80, 81, 82)), [a, b]) == Pick("b")


def test_sglang_exactly_at_the_threshold_is_not_a_cache_hit() -> None:
    policy = SglangCachePolicy(cache_threshold=0.5)
    a, b = cand("a"), cand("b")
    policy.pick(RouteRequest("warm", 4096, (1, 2, 3, 4, 5, 6, 7, 8)), [a])  # a: the bigger tree
    policy.pick(RouteRequest("other", 512, (50,)), [b])
    # 1 of 2 segments match on a: rate 0.5, not above 0.5 → the smallest tree (b).
    assert policy.pick(RouteRequest("half", 1024, (1, 60)), [a, b]) == Pick("b")
    assert policy.pick(RouteRequest("more", 1536, (1, 2, 61)), [a, b]) == Pick("a")  # 2/3 > 0.5


def test_sglang_match_rate_is_the_share_of_the_prompts_tokens_matched() -> None:
    """SGLang's match rate is matched characters over the prompt's characters. Segments are 512 tokens but the last,
    which holds what is left: counting segments, a prompt's short tail weighed as much as a whole segment."""
    policy = SglangCachePolicy()
    a, b = cand("a"), cand("b")
    policy.tree("a").insert(RouteRequest("old", 512, (1,)))  # a holds the first 512 tokens
    policy.tree("b").insert(RouteRequest("pad", 100, (99,)))  # b's tree is the smaller
    # 3 whole segments and a 24-token tail: 512 of 1,560 tokens match on a (0.33 > 0.3), though 1 of 4 segments.
    assert policy.pick(RouteRequest("new", 1560, (1, 2, 3, 4)), [a, b]) == Pick("a")
    # 512 of 2,048 (0.25): the smallest tree.
    assert policy.pick(RouteRequest("far", 2048, (1, 7, 8, 9)), [a, b]) == Pick("b")


def test_sglang_imbalanced_fleet_routes_to_the_least_loaded_even_with_a_full_match() -> None:
    policy = SglangCachePolicy()
    a, b, c = cand("a"), cand("b"), cand("c")
    policy.pick(RouteRequest("warm", 1024, (1, 2)), [a])
    _loaded(policy, "a", 69, "x")  # a: 70 in flight
    _loaded(policy, "b", 4, "y")  # b: 4
    _loaded(policy, "c", 2, "z")  # c: 2 → max − min = 68 > 64 and 70 > 1.5 × 2: imbalanced
    assert not policy.balanced([a, b, c])
    assert policy.pick(RouteRequest("hit", 1024, (1, 2)), [a, b, c]) == Pick("c")


def test_sglang_needs_both_thresholds_exceeded_to_call_it_imbalanced() -> None:
    policy = SglangCachePolicy()
    a, b = cand("a"), cand("b")
    _loaded(policy, "a", 200, "x")
    _loaded(policy, "b", 140, "y")  # max − min = 60 ≤ 64: balanced although 200 > 1.5 × 140 is false too
    assert policy.balanced([a, b])
    _loaded(policy, "a", 10, "w")  # 210 − 140 = 70 > 64 but 210 ≤ 1.5 × 140: still balanced
    assert policy.balanced([a, b])
    _loaded(policy, "a", 1, "v")  # 211 > 210 = 1.5 × 140 and 71 > 64: imbalanced
    assert not policy.balanced([a, b])


def test_sglang_load_falls_when_requests_complete() -> None:
    policy = SglangCachePolicy()
    pick = policy.pick(RouteRequest("r", 100), [cand("a")])
    assert policy.load("a") == 1
    policy.observe(done("r", pick.endpoint_id))
    assert policy.load("a") == 0


def test_sglang_load_falls_when_a_request_fails() -> None:
    """SGLang's load guard drops with the response, an error's too: a failed request stayed in the load for ever."""
    policy = SglangCachePolicy()
    cands = [cand("p0", role="prefill"), cand("d0", role="decode")]
    policy.pick(RouteRequest("r", 100), cands)
    assert (policy.load("p0"), policy.load("d0")) == (1, 1)
    policy.abandon("r")
    policy.abandon("never routed")
    assert (policy.load("p0"), policy.load("d0")) == (0, 0)


def test_sglang_forgets_the_tree_of_an_endpoint_that_left() -> None:
    """SGLang's router drops a removed worker's tree: an endpoint that left and came back under its name (restarted,
    its cache empty) was still credited with every prompt sent before, and drew their followers to an empty cache."""
    policy = SglangCachePolicy()
    a, b = cand("a"), cand("b")
    policy.pick(RouteRequest("warm", 2048, (1, 2, 3, 4)), [a])
    policy.pick(RouteRequest("other", 512, (50,)), [b])
    policy.forget_endpoint("a")
    assert policy.tree("a").tokens == 0.0
    policy.pick(RouteRequest("back", 1024, (70, 71)), [a])  # a's tree afresh, larger than b's
    # no match anywhere now: the follower goes to the smallest tree (b), not to a as a cache hit
    assert policy.pick(RouteRequest("follow", 2048, (1, 2, 3, 4)), [a, b]) == Pick("b")
    policy.forget_endpoint("never seen")


def test_sglang_pd_picks_prefill_and_decode_each_by_its_own_trees() -> None:
    policy = SglangCachePolicy()
    cands = [cand("p0", role="prefill"), cand("p1", role="prefill"), cand("d0", role="decode")]
    first = policy.pick(RouteRequest("1", 1024, (1, 2)), cands)
    assert first.is_pair and first.decode_endpoint_id == "d0"
    again = policy.pick(RouteRequest("2", 1024, (1, 2)), cands)
    assert again.endpoint_id == first.endpoint_id
    policy.observe(done("1", first.endpoint_id, "d0"))
    assert policy.load("d0") == 1 and policy.load(first.endpoint_id) == 1


# ------------------------------------------------------------------------------------------------ all peers


PEERS = ("round_robin", "least_queue", "llmd_heuristic", "dynamo_kv", "sglang_cache", "random")


@pytest.mark.parametrize("name", PEERS)
def test_no_peer_reads_the_time_slice_orchestrator(name: str) -> None:
    """A sleeping engine still answers its health check and /metrics: peers keep offering it requests."""
    policy = make_policy(name)
    assert isinstance(policy, RoutingPolicy) and policy.name == name
    cands = [cand("a", timeslice="parked"), cand("b", timeslice="resident"), cand("c", timeslice="switching")]
    picked = {policy.pick(RouteRequest(str(i), 600, (i,)), cands).endpoint_id for i in range(40)}
    if name in ("round_robin", "random"):
        assert picked == {"a", "b", "c"}
    pd = [cand("p0", role="prefill", timeslice="parked"), cand("p1", role="prefill"), cand("d0", role="decode")]
    assert policy.pick(RouteRequest("y", 600), pd).decode_endpoint_id == "d0"


def _in_flight(policy: object) -> object:
    """What a peer counts in flight, nothing left out."""
    if isinstance(policy, SglangCachePolicy):
        return {e: policy.load(e) for e in ("a", "b", "p0", "p1", "d0") if policy.load(e)}
    if isinstance(policy, DynamoKvPolicy):
        return {e: policy.active_blocks(e) for e in ("a", "b", "p0", "p1", "d0") if policy.active_blocks(e)}
    assert isinstance(policy, LlmdPredictedPolicy)
    counted = policy._counters
    prefill, decode = ({k: v for k, v in side.items() if v} for side in (counted.prefill, counted.decode))
    return (prefill or decode or counted.routed) and (prefill, decode, counted.routed)


@pytest.mark.parametrize("name", ["dynamo_kv", "sglang_cache", "llmd_predicted"])
@pytest.mark.parametrize("pd", [False, True])
def test_a_request_decided_again_under_its_id_counts_once_and_leaves_with_its_outcome(name: str, pd: bool) -> None:
    """A request picked again under its id (a retry, the first attempt not abandoned) is routed anew: what its first
    pick counted was kept for ever (SGLang's load, Dynamo's active blocks, llm-d's tokens in flight) while its
    outcome let go of the second alone. LeadtimePolicy lets go of both with the outcome; a peer now moves it."""
    made: dict[str, Callable[[], DynamoKvPolicy | SglangCachePolicy | LlmdPredictedPolicy]] = {
        "dynamo_kv": DynamoKvPolicy,
        "sglang_cache": SglangCachePolicy,
        "llmd_predicted": lambda: LlmdPredictedPolicy(LlmdReference(retrain_every=None), retrain_every_ms=None),
    }
    policy = made[name]()
    unified = [cand("a"), cand("b")]
    cands = [cand("p0", role="prefill"), cand("p1", role="prefill"), cand("d0", role="decode")] if pd else unified
    first = policy.pick(RouteRequest("r", 600, (1,)), cands)
    again = policy.pick(RouteRequest("r", 600, (1,)), cands)
    if hasattr(policy, "prefilled"):
        policy.prefilled("r", 1.0)
    policy.observe(done("r", again.endpoint_id, again.decode_endpoint_id))
    assert not _in_flight(policy), (first, again)


def test_the_readiness_filter_variant_of_llmd_skips_parked_endpoints_unless_all_are() -> None:
    policy = make_policy("llmd_heuristic_ready")
    cands = [cand("a", timeslice="parked"), cand("b", timeslice="resident"), cand("c", timeslice="switching")]
    assert all(policy.pick(RouteRequest(str(i), 600, (i,)), cands) == Pick("b") for i in range(12))
    parked = [cand("a", timeslice="parked"), cand("c", timeslice="switching")]
    assert policy.pick(RouteRequest("x", 600), parked).endpoint_id in ("a", "c")


def test_registry_names_and_spellings() -> None:
    learning = {"llmd_predicted", *LEADTIME_POLICIES, *REPLICATED_POLICIES, *SHADOW_POLICIES}
    assert set(PEERS) | {"clairvoyant", "llmd_heuristic_ready"} | learning == set(POLICY_NAMES)
    for spelling, name in [
        ("round-robin", "round_robin"),
        ("least-queue", "least_queue"),
        ("llm-d", "llmd_heuristic"),
        ("llmd-heuristic", "llmd_heuristic"),
        ("dynamo-kv", "dynamo_kv"),
        ("sglang-cache", "sglang_cache"),
    ]:
        assert make_policy(spelling).name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="needs the fleet"):
        make_policy("leadtime")
