"""The SLO-aware clairvoyant policy: exact ITL of the batch a request joins, the slack rule, joint P/D pairs;
and the copy-on-write cache fork that keeps its what-if runs cheap."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from leadtime.features.catalog import get_model
from leadtime.features.roofline import kv_transfer_ms
from leadtime.router_plugin.policy import Candidate, Pick, RouteRequest
from leadtime.simulator.clairvoyant import ClairvoyantPolicy, Estimate, slack
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.kvcache import KVCache
from leadtime.simulator.steptime import StepTimeModel
from leadtime.simulator.workload import WorkloadRequest

MODEL = "llama-3.1-8b"


def _endpoint(role: str = "both", accelerator: str = "h100-sxm") -> Endpoint:
    stepper = StepTimeModel(accelerator, get_model(MODEL))
    return Endpoint("e0", role, stepper, KVCache(20_000, 16), 2048, 64)


def _decoding(endpoint: Endpoint, contexts: Sequence[int], output_tokens: int = 500) -> None:
    """Run requests with these prompt lengths on `endpoint` until every one of them is decoding."""
    for i, tokens in enumerate(contexts):
        endpoint.enqueue(SimRequest(100 + i, 0.0, tokens, output_tokens))
    clock = 0.0
    while any(not r.decoding for r in endpoint.running) or endpoint.waiting:
        plan = endpoint.start_step(clock)
        assert plan is not None
        clock = plan.end_ms
        endpoint.finish_step()


def test_joining_step_is_the_true_decode_step_of_the_batch_with_the_request_added() -> None:
    e = _endpoint()
    _decoding(e, [1000, 3000, 500])
    kv = sum(r.input_tokens + r.generated for r in e.running)
    a, b = e.stepper.decode_affine(4)
    predicted = e.joining_step_ms(2000)
    assert predicted == pytest.approx(a + b * (kv + 2001))
    # The engine's own next step once the request has joined (its KV transferred in, first token sampled).
    joined = SimRequest(9, 0.0, 2000, 50, kv_ready=True, generated=1)
    e.enqueue(joined)
    plan = e.start_step(0.0)
    assert plan is not None and joined.decoding and len(plan.entries) == 4
    assert plan.end_ms - plan.start_ms == pytest.approx(predicted, rel=1e-9)


def test_joining_step_counts_waiting_requests_and_kv_in_transit_up_to_the_running_cap() -> None:
    e = _endpoint()
    _decoding(e, [1000])
    e.enqueue(SimRequest(7, 0.0, 4000, 10))
    a3, b3 = e.stepper.decode_affine(3)
    assert e.joining_step_ms(500) == pytest.approx(a3 + b3 * (1001 + 4000 + 501))
    a4, b4 = e.stepper.decode_affine(4)
    assert e.joining_step_ms(500, [6000]) == pytest.approx(a4 + b4 * (1001 + 4000 + 6000 + 501))
    e.max_running = 2
    a2, b2 = e.stepper.decode_affine(2)
    assert e.joining_step_ms(500, [6000]) == pytest.approx(a2 + b2 * (1001 + 501))


def test_clairvoyant_estimate_is_what_happens_with_no_later_arrival() -> None:
    fleet = parse_fleet({"pools": [{"name": "h", "count": 1, "accelerator": "h100-sxm", "model": MODEL}]})
    workload = [WorkloadRequest(0.0, 3000, 200), WorkloadRequest(0.0, 2000, 200), WorkloadRequest(0.0, 1500, 200)]
    seen: list[Estimate] = []

    class Recorder(ClairvoyantPolicy):
        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            estimate = self.estimate(request, candidates[0].endpoint_id)
            assert estimate is not None
            seen.append(estimate)
            return super().pick(request, candidates)

    result = FleetSimulator(fleet, workload, Recorder()).run()
    last = result.completed[2]
    assert seen[2].ttft_ms == pytest.approx(last.ttft_ms)
    # Its ITL: the three-request batch's step when it joins; the batch's KV grows by one token a step after.
    assert seen[2].itl_ms == pytest.approx(last.itl_ms, rel=0.02)
    assert seen[2].itl_ms > seen[0].itl_ms  # the first request was alone


def test_slack_rule_takes_the_most_slack_else_the_smallest_miss() -> None:
    assert slack(Estimate(200.0, 90.0), 1000.0, 100.0) == pytest.approx(0.1)  # ITL is the tighter one
    assert slack(Estimate(200.0, 90.0), None, None) == pytest.approx(-0.2)
    assert slack(Estimate(200.0, 90.0), None, 100.0) == pytest.approx(0.1)

    class Scripted(ClairvoyantPolicy):
        def __init__(self, estimates: dict[str, Estimate]) -> None:
            super().__init__()
            self.estimates = estimates
            self.bounds: list[float] = []
            self.upper: dict[str, float] = {}

        def estimate(
            self, request: RouteRequest, endpoint_id: str, give_up_after_ms: float = math.inf
        ) -> Estimate | None:
            self.bounds.append(give_up_after_ms)
            estimate = self.estimates[endpoint_id]
            return None if estimate.ttft_ms > give_up_after_ms else estimate  # the fork was cut

        def _upper_slack(self, request: RouteRequest, endpoint_id: str, itl_ms: float | None = None) -> float:
            return self.upper.get(endpoint_id, 1.0)

        def _cannot_win(self, request: RouteRequest, endpoint_id: str, give_up_ms: float, best: float) -> bool:
            return False

    from leadtime.features.rows import EndpointState

    cands = [Candidate(EndpointState(endpoint_id=n, num_request_waiting=i)) for i, n in enumerate("abc")]
    request = RouteRequest("1", 100, ttft_slo_ms=1000.0, tpot_slo_ms=50.0)
    meets = Scripted({"a": Estimate(900.0, 10.0), "b": Estimate(300.0, 30.0), "c": Estimate(100.0, 49.0)})
    assert meets.pick(request, cands) == Pick("b")  # slacks 0.1, 0.4, 0.02
    # The first fork stops at the horizon (twice the TTFT SLO), the others where they could no longer win.
    assert meets.bounds == [pytest.approx(2000.0), pytest.approx(900.0), pytest.approx(600.0)]
    misses = Scripted({"a": Estimate(3000.0, 10.0), "b": Estimate(1500.0, 80.0), "c": Estimate(1800.0, 40.0)})
    assert misses.pick(request, cands) == Pick("b")  # misses by 2.0 (past the horizon: cut), 0.6, 0.8
    assert misses.bounds == [pytest.approx(2000.0), pytest.approx(2000.0), pytest.approx(1600.0)]
    # Candidates are tried best upper bound first, and none is forked once no bound left beats the best.
    pruned = Scripted({"a": Estimate(900.0, 10.0), "b": Estimate(300.0, 30.0), "c": Estimate(100.0, 49.0)})
    pruned.upper = {"a": 0.2, "b": 0.5, "c": 0.3}
    assert pruned.pick(request, cands) == Pick("b")
    assert pruned.bounds == [pytest.approx(2000.0)]  # b (slack 0.4) beats every bound left: c ≤ 0.3, a ≤ 0.2
    # Past the horizon everywhere: no smallest miss is sought; the best bound wins (the least TTFT lower bound).
    hopeless = Scripted({"a": Estimate(30_000.0, 10.0), "b": Estimate(12_000.0, 10.0), "c": Estimate(40_000.0, 10.0)})
    assert hopeless.pick(request, cands) == Pick("a")  # every fork cut at the horizon; bounds tie: the first
    assert hopeless.bounds == [pytest.approx(2000.0)] * 3
    hopeless.bounds, hopeless.upper = [], {"a": -5.0, "b": -9.0, "c": -3.0}
    assert hopeless.pick(request, cands) == Pick("c")
    assert hopeless.bounds == []  # the bounds alone put every candidate past the horizon: no fork at all


def test_cheap_bounds_never_exceed_the_exact_figures() -> None:
    fleet = parse_fleet(
        {
            "pools": [
                {"name": "h", "count": 2, "accelerator": "h100-sxm", "model": MODEL},
                {"name": "l", "count": 1, "accelerator": "l40s", "model": MODEL},
            ],
            "realism": {"step_jitter": 0.08, "speed_spread": 0.05},
        }
    )
    checked: list[tuple[float, float]] = []
    sure_tight: list[float] = []

    class Checker(ClairvoyantPolicy):
        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            sim = self._simulator()
            for c in candidates:
                e = sim.by_id[c.endpoint_id]
                exact = self.estimate(request, c.endpoint_id)
                assert exact is not None
                low = e.ttft_lower_bound_ms(self._probe(request), sim.now, sim.resume_time(c.endpoint_id))
                assert low <= exact.ttft_ms + 1e-9
                assert e.itl_lower_bound_ms(request.input_tokens) <= exact.itl_ms + 1e-9
                # If the prefill completes within a horizon, the requests sure to be running bound the ITL.
                for horizon in (exact.ttft_ms, exact.ttft_ms * 1.5 + 1.0):
                    sure = e.sure_joining_step_ms(request.input_tokens, sim.now, horizon)
                    assert sure <= exact.itl_ms * (1 + 1e-9)
                    sure_tight.append(sure / exact.itl_ms)
                checked.append((low, exact.ttft_ms))
            return super().pick(request, candidates)

    rng = random.Random(4)
    prefixes = [[f"p{g}-{i}" for i in range(4)] for g in range(3)]
    from leadtime.features.prefix import chain_block_ids

    workload = []
    for i in range(150):
        ids: list[object] = [*rng.choice(prefixes), *(f"u{i}-{k}" for k in range(rng.randint(1, 8)))]
        workload.append(
            WorkloadRequest(
                i * 40.0, 512 * len(ids) - rng.randint(0, 400), rng.randint(2, 200), tuple(chain_block_ids(ids))
            )
        )
    FleetSimulator(fleet, workload, Checker(), seed=1).run()
    assert len(checked) == 450 and any(exact > 3 * low for low, exact in checked)  # queues were exercised
    assert max(sure_tight) > 0.9  # the sure batch is often (nearly) the whole batch


def _pd_sim() -> FleetSimulator:
    doc: dict[str, object] = {
        "kv_link_gb_s": 10,
        "pools": [
            {"name": "pfast", "count": 1, "accelerator": "h100-sxm", "model": MODEL, "role": "prefill"},
            {"name": "pslow", "count": 1, "accelerator": "a100-sxm-80gb", "model": MODEL, "role": "prefill"},
            # L40S decode endpoints: prefilling there (no disaggregation) is slow, so the pair is what counts.
            {"name": "d", "count": 2, "accelerator": "l40s", "model": MODEL, "role": "decode"},
        ],
    }
    return FleetSimulator(parse_fleet(doc), [], ClairvoyantPolicy())


def test_pair_choice_is_joint_prefill_and_link() -> None:
    sim = _pd_sim()
    policy = sim.policy
    assert isinstance(policy, ClairvoyantPolicy)
    request = RouteRequest("1", 8000, ttft_slo_ms=1500.0, tpot_slo_ms=100.0)
    probe = SimRequest(1, 0.0, 8000, 10)
    # d-0's link is busy for 2 s with earlier transfers; d-1's is free.
    sim._link_free["d-0"] = 2000.0
    pick = policy.pick(request, sim.candidates(probe))
    assert pick == Pick("pfast-0", "d-1")
    prefill = policy.exact_ttft_ms(request, "pfast-0")
    transfer = kv_transfer_ms(get_model(MODEL), 8000, 10, 1)
    assert policy.transfer_done_ms(request, "d-1", prefill) == pytest.approx(prefill + transfer)
    assert policy.transfer_done_ms(request, "d-0", prefill) == pytest.approx(2000.0 + transfer)


def test_pair_choice_weighs_the_decode_batch_against_the_link() -> None:
    sim = _pd_sim()
    policy = sim.policy
    assert isinstance(policy, ClairvoyantPolicy)
    # d-1 has a free link but a huge batch (ITL over the SLO); d-0 a short link wait and an empty batch.
    for i in range(60):
        sim.by_id["d-1"].enqueue(SimRequest(1000 + i, 0.0, 12_000, 400, kv_ready=True))
    sim._link_free["d-0"] = 300.0
    request = RouteRequest("1", 4000, ttft_slo_ms=3000.0, tpot_slo_ms=40.0)
    assert policy.decode_itl_ms(request, "d-1") > 40.0 > policy.decode_itl_ms(request, "d-0")
    pick = policy.pick(request, sim.candidates(SimRequest(1, 0.0, 4000, 10)))
    assert pick.decode_endpoint_id == "d-0" or pick == Pick("d-0")


def test_pair_choice_beats_decode_first() -> None:
    """llm-d's order (the best decode endpoint alone, then the best prefill) misses where the joint pick meets."""
    sim = _pd_sim()
    policy = sim.policy
    assert isinstance(policy, ClairvoyantPolicy)
    request = RouteRequest("1", 6000, ttft_slo_ms=800.0, tpot_slo_ms=60.0)
    probe = SimRequest(1, 0.0, 6000, 10)
    # d-0 decodes fastest (empty) but its link is busy; d-1 carries a few requests and its link is free.
    for i in range(4):
        sim.by_id["d-1"].enqueue(SimRequest(1000 + i, 0.0, 2000, 400, kv_ready=True))
    sim._link_free["d-0"] = 1500.0
    decode_first = min(("d-0", "d-1"), key=lambda d: policy.decode_itl_ms(request, d))
    assert decode_first == "d-0"
    prefill = policy.exact_ttft_ms(request, "pfast-0")
    assert policy.transfer_done_ms(request, "d-0", prefill) > 800.0  # decode-first misses the TTFT SLO
    pick = policy.pick(request, sim.candidates(probe))
    assert pick.decode_endpoint_id == "d-1" or pick == Pick("d-1")
    assert policy.transfer_done_ms(request, "d-1", prefill) < 800.0


def test_in_transit_requests_count_in_the_decode_batch() -> None:
    sim = _pd_sim()
    policy = sim.policy
    assert isinstance(policy, ClairvoyantPolicy)
    request = RouteRequest("5", 4000, ttft_slo_ms=3000.0, tpot_slo_ms=100.0)
    before = policy.decode_itl_ms(request, "d-0")
    first = policy.pick(request, sim.candidates(SimRequest(5, 0.0, 4000, 10)))
    bound = first.decode_endpoint_id or first.endpoint_id
    assert policy.decode_itl_ms(RouteRequest("6", 4000), bound) > before  # bound there, KV not there yet


# ----------------------------------------------------------------------------------------- cache fork


def _cache_state(cache: KVCache) -> tuple[object, ...]:
    full = cache.clone()
    entries = {h: (e.blocks, e.refs, e.cached_at_ms) for h, e in full.entries.items()}
    return (full.private_blocks, full.prefix_blocks, full.evictable_blocks, entries, list(full._unreferenced))


@pytest.mark.parametrize("seed", range(6))
def test_a_forked_cache_behaves_exactly_like_a_full_copy(seed: int) -> None:
    rng = random.Random(seed)
    base = KVCache(400, 16)
    held: list[list[int]] = []
    # Build a base with referenced and unreferenced entries.
    for step in range(60):
        hashes = [rng.randrange(40) for _ in range(rng.randint(1, 3))]
        hashes = [h for h in dict.fromkeys(hashes) if h not in base.entries]
        if hashes and base.allocate(4 * len(hashes)):
            base.publish_prefix(hashes, 4, float(step))
            held.append(hashes)
        if held and rng.random() < 0.6:
            base.release_prefix(held.pop(rng.randrange(len(held))))
    copy, fork = base.clone(), base.fork()
    assert _cache_state(fork) == _cache_state(copy)
    fork_held = [list(h) for h in held]
    copy_held = [list(h) for h in held]
    evictions = 0
    for step in range(200):
        op = rng.random()
        if op < 0.3:
            hashes = [rng.randrange(60) for _ in range(rng.randint(1, 4))]
            m_copy, m_fork = copy.matched_prefix(hashes), fork.matched_prefix(hashes)
            assert m_copy == m_fork
            if m_copy:
                copy.acquire_prefix(hashes[:m_copy])
                fork.acquire_prefix(hashes[:m_fork])
                copy_held.append(hashes[:m_copy])
                fork_held.append(hashes[:m_fork])
        elif op < 0.55:
            blocks = rng.randint(1, 120)
            cached = copy.prefix_blocks
            assert copy.allocate(blocks) == fork.allocate(blocks)
            evictions += copy.prefix_blocks < cached
        elif op < 0.75:
            hashes = [h for h in dict.fromkeys(rng.randrange(60) for _ in range(2)) if copy.matched_prefix([h]) == 0]
            if hashes and copy.allocate(4 * len(hashes)):
                assert fork.allocate(4 * len(hashes))
                copy.publish_prefix(hashes, 4, 100.0 + step)
                fork.publish_prefix(hashes, 4, 100.0 + step)
                copy_held.append(hashes)
                fork_held.append(hashes)
        elif op < 0.95 and copy_held:
            i = rng.randrange(len(copy_held))
            copy.release_prefix(copy_held.pop(i))
            fork.release_prefix(fork_held.pop(i))
        elif op >= 0.99:
            copy.clear_unreferenced()
            fork.clear_unreferenced()
        if copy.private_blocks > 200:
            copy.free(100)
            fork.free(100)
        assert (copy.free_blocks, copy.evictable_blocks) == (fork.free_blocks, fork.evictable_blocks)
    assert _cache_state(fork) == _cache_state(copy)
    assert evictions > 0  # the LRU order was exercised
    assert _cache_state(base.clone()) == _cache_state(base)  # the base never changed


def test_the_clairvoyant_sees_a_resident_endpoint_being_handed_to_the_other_job() -> None:
    doc = {
        "pools": [{"name": "shared", "count": 1, "accelerator": "h100-sxm", "model": MODEL, "timeslice_group": "g"}],
        "timeslice_groups": {
            "g": {
                "resident_ms": {"distribution": "fixed", "value": 100},
                "away_ms": {"distribution": "fixed", "value": 5000},
                "restore_ms": {"distribution": "fixed", "value": 80},
            }
        },
    }
    sim = FleetSimulator(parse_fleet(doc), [], ClairvoyantPolicy())
    policy = sim.policy
    assert isinstance(policy, ClairvoyantPolicy)
    request = RouteRequest("1", 16_000)
    sim.routing = SimRequest(1, 0.0, 16_000, 101)
    sim.groups["g"].until_ms = math.inf
    alone = policy.estimate(request, "shared-0")
    assert alone is not None and alone.ttft_ms > 100.0
    sim.groups["g"].until_ms = 50.0  # swapped out before its prefill completes: preempted, back 5,080 ms later
    parked = policy.estimate(request, "shared-0")
    assert parked is not None and parked.ttft_ms > 5080.0 + 50.0
    sim.groups["g"].until_ms = alone.ttft_ms + 5 * alone.itl_ms  # swapped out while it decodes
    hit = policy.estimate(request, "shared-0")
    assert hit is not None and hit.ttft_ms == pytest.approx(alone.ttft_ms)
    assert hit.itl_ms == pytest.approx(alone.itl_ms + 5080.0 / 100)
