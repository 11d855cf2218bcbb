"""Holding at the router (`Pick.hold`): what the Leadtime policy holds and for how long, how a held request is
scored when offered again, and how the simulator and the gateway offer it again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping, Sequence
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
from test_router_plugin import QueueModel, cand, req

from leadtime.bench.procs import free_port
from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.discovery import StaticDiscovery, parse_static
from leadtime.router_plugin.gateway import app as gateway_app
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.pairs import PairPredictions, choose_pair
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy
from leadtime.simulator.engine import MAX_HOLD_MS, FleetSimulator, SimulationError
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.serve import FleetServer
from leadtime.simulator.workload import WorkloadRequest

HOLD = LeadtimeConfig(exploration=0.0, hold_slo_multiple=2.0)


def overloaded(config: LeadtimeConfig = HOLD) -> LeadtimePolicy:
    """A policy whose recent decisions mostly found no candidate in time (the overflow cap let go)."""
    policy = LeadtimePolicy(QueueModel(), config)
    policy.overload = 1.0
    return policy


def test_under_sustained_overload_a_request_beyond_saving_everywhere_is_held_not_queued() -> None:
    # QueueModel: TTFT 1.2 × (70 + 200 × 40) ms ≈ 9.7 s at the p90, 8.1 s by the mean, against a 2 s SLO.
    model = QueueModel()
    policy = LeadtimePolicy(model, HOLD)
    policy.overload = 1.0
    candidates = [cand("a", waiting=40), cand("b", waiting=40)]
    assert policy.pick(req("r1"), candidates).hold
    assert policy.pick(req("r2", at=1.0), candidates).hold
    assert policy.counters.held == 2
    # Nothing was sent: the second request saw no in-flight addition from the first.
    assert {r.endpoint.num_request_waiting for r in model.asked[-1]} == {40}
    # A held request still counts, when it comes in, as one that found no candidate in time.
    shared = LeadtimePolicy(QueueModel(), HOLD)
    shared.overload = 0.3
    assert shared.pick(req("r0"), candidates).hold and shared.overload > 0.3
    # Offered again until it has waited twice its TTFT SLO, then placed with those beyond saving (the overflow).
    assert policy.pick(replace(req("r1", at=3999.0), held_ms=3999.0), candidates).hold
    placed = policy.pick(replace(req("r1", at=4000.0), held_ms=4000.0), candidates)
    assert not placed.hold and placed.endpoint_id == "a"
    # Held, it leaves no decision behind: an outcome reported for it would teach nothing.
    policy.observe(Outcome("r2", "a", None, 100.0, 20.0, 5, 5000.0))
    assert policy.counters.learned == 0


def test_a_request_is_held_only_under_sustained_overload_only_when_beyond_saving_and_only_with_a_ttft_slo() -> None:
    beyond = [cand("a", waiting=40), cand("b", waiting=40)]
    # Capacity to spare (few recent decisions without a candidate in time): the overflow endpoint takes it.
    calm = LeadtimePolicy(QueueModel(), HOLD)
    assert not calm.pick(req("r1"), beyond).hold
    # Its mean ITL meets the SLO (10 + 2 × 42 = 94 ms; the p90 113 ms misses): it may be served in time: sent.
    saveable = [cand("a", waiting=40), cand("b", running=42)]
    assert overloaded().pick(req("r2"), saveable).endpoint_id == "b"
    # No TTFT SLO, or holding switched off: never held.
    assert not overloaded().pick(req("r3", ttft_slo=None), beyond).hold
    assert not overloaded(replace(HOLD, hold_slo_multiple=0.0)).pick(req("r4"), beyond).hold


def test_a_held_request_is_held_on_whatever_the_overload_and_does_not_move_the_overload_share() -> None:
    policy = LeadtimePolicy(QueueModel(), HOLD)
    beyond = [cand("a", waiting=40)]
    assert policy.pick(replace(req("r1", at=50.0), held_ms=50.0), beyond).hold
    assert policy.overload == 0.0  # counted once, when it first came in


def test_a_held_request_is_scored_against_what_is_left_of_its_ttft_slo() -> None:
    # 5 waiting: TTFT 1.2 × 1,070 = 1,284 ms at the p90, 1,070 ms by the mean; in time against 2 s when it comes in.
    candidates = [cand("a", waiting=5)]
    assert not overloaded().pick(req("fresh"), candidates).hold
    # Having waited 1 s at the router, 1 s is left: even its mean misses it, so it is held on...
    assert overloaded().pick(replace(req("late", at=1000.0), held_ms=1000.0), candidates).hold
    # ...and after 0.5 s, 1.5 s is left: the mean meets it and the p90 does not, so it is sent.
    assert not overloaded().pick(replace(req("soon", at=500.0), held_ms=500.0), candidates).hold


def test_past_its_hold_a_request_goes_with_those_beyond_saving_even_where_it_would_have_missed_least() -> None:
    # a: 40 waiting, beyond saving (p90 9.7 s against 2 s). b: 10 waiting, a small miss (p90 2.5 s, mean 2.1 s).
    # Between a quarter and half of recent decisions without a candidate in time, a request coming in with its
    # whole SLO would go where it misses least, b, without the hold; with it, it waits.
    candidates = [cand("a", waiting=40), cand("b", waiting=10)]
    unheld = overloaded(replace(HOLD, hold_slo_multiple=0.0))
    unheld.overload = 0.4
    assert unheld.pick(req("fresh"), candidates).endpoint_id == "b"
    policy = overloaded(replace(HOLD, hold_slo_multiple=1.0))
    policy.overload = 0.4
    assert policy.pick(req("r"), candidates).hold
    assert policy.pick(replace(req("r", at=1000.0), held_ms=1000.0), candidates).hold
    # Its TTFT SLO spent, every candidate misses what is left of it by far: it is given up to the overflow
    # endpoint (a), where it does not slow down the requests b can still serve in time.
    assert policy.pick(replace(req("r", at=2000.0), held_ms=2000.0), candidates).endpoint_id == "a"


def test_pd_pairs_beyond_saving_are_held_and_a_pair_that_may_be_saved_is_not() -> None:
    prefill = [cand("p1", role="prefill", waiting=40), cand("p2", role="prefill", waiting=40)]
    decode = [cand("d1", role="decode"), cand("d2", role="decode")]
    config = replace(HOLD, inflight=False, local_prefill=False)
    assert overloaded(config).pick(req("r1"), prefill + decode).hold
    prefill[1] = cand("p2", role="prefill")
    pick = overloaded(config).pick(req("r2"), prefill + decode)
    assert not pick.hold and pick.endpoint_id == "p2"


def test_a_pair_choice_says_whether_any_pair_may_still_be_saved() -> None:
    def predictions(prefill_mean: float) -> PairPredictions:
        return PairPredictions(
            prefill_ttft=np.array([3000.0, 4000.0]),
            prefill_ttft_mean=np.array([prefill_mean, 3500.0]),
            decode_itl=np.array([20.0]),
            decode_itl_mean=np.array([18.0]),
            local_ttft=None,
            local_ttft_mean=None,
            link_free_ms=np.array([0.0]),
            transfer_ms=np.array([50.0]),
        )

    # Every p90 misses the 2 s SLO; a mean of 1.5 s (+ 50 ms transfer) meets it, one of 2.5 s does not.
    for decode_first in (False, True):
        assert choose_pair(predictions(1500.0), 0.0, 2000.0, 60.0, decode_first=decode_first).saveable
        assert not choose_pair(predictions(2500.0), 0.0, 2000.0, 60.0, decode_first=decode_first).saveable
    fresh = replace(predictions(2500.0), prefill_ttft=np.array([1000.0, 4000.0]))
    assert choose_pair(fresh, 0.0, 2000.0, 60.0).saveable


# ------------------------------------------------------------------------------ offered again


class HoldsOnce:
    """Holds every request the first time it is offered, then sends it to the first candidate."""

    name = "holds_once"

    def __init__(self) -> None:
        self.offers: list[tuple[str, float, float]] = []

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        self.offers.append((request.request_id, request.arrival_ms, request.held_ms))
        return Pick.held() if not request.held_ms else Pick(candidates[0].endpoint_id)

    def observe(self, outcome: Outcome) -> None:
        pass


class HoldsForever(HoldsOnce):
    name = "holds_forever"

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        return Pick.held()


FLEET = parse_fleet(
    {
        "name": "one",
        "refresh_ms": 100,
        "pools": [{"name": "h", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}],
    }
)
WORK = [WorkloadRequest(arrival_ms=30.0 + 250.0 * i, input_tokens=200, output_tokens=4) for i in range(4)]


def test_the_simulator_offers_a_held_request_again_at_the_next_state_and_counts_its_wait() -> None:
    policy = HoldsOnce()
    held = FleetSimulator(FLEET, WORK, policy).run()
    # Each request comes in at 30 + 250 i ms and is offered again at the next publication (every 100 ms).
    again = [(rid, at, wait) for rid, at, wait in policy.offers if wait]
    assert [at for _, at, _ in again] == [100.0, 300.0, 600.0, 800.0]
    assert [round(wait, 6) for _, _, wait in again] == [70.0, 20.0, 70.0, 20.0]
    # Its TTFT counts from when it came in: the wait at the router comes on top of what the endpoint took.
    direct = FleetSimulator(FLEET, WORK, SendsAtOnce()).run()
    for h, d, (_, _, wait) in zip(held.completed, direct.completed, again, strict=True):
        assert h.ttft_ms == pytest.approx(d.ttft_ms + wait, abs=1.0)
    # What the policy is told and the predictor learns is what the endpoint took, from when the request was sent.
    assert [round(o.actual_ttft_ms, 6) for o in held.observations] == [round(c.ttft_ms, 6) for c in direct.completed]


class SendsAtOnce(HoldsOnce):
    """Sends every request at once, to the first candidate."""

    name = "sends_at_once"

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        return Pick(candidates[0].endpoint_id)


def test_the_simulator_refuses_a_policy_that_never_places_a_request() -> None:
    with pytest.raises(SimulationError, match=f"held request 0 for over {MAX_HOLD_MS / 1e3:.0f} s"):
        FleetSimulator(FLEET, WORK[:1], HoldsForever()).run()


# ------------------------------------------------------------------------------ the gateway


def through_gateway(
    policy: HoldsOnce, requests: int, leave_after_s: float | None = None
) -> tuple[list[int | None], dict[str, float]]:
    """`requests` completions through an in-process gateway with `policy`, in front of one `sim serve` endpoint;
    their status codes (None for a client that left after `leave_after_s` without an answer) and the gateway's
    counts: requests held and for how long, fallbacks because of the policy, requests answered 499."""
    server = FleetServer(FLEET, [free_port()])
    server.start()

    async def leaving(gateway: Gateway, body: bytes) -> int | None:
        """A client that sends its request, then goes away after `leave_after_s`."""
        sent: list[MutableMapping[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            assert leave_after_s is not None
            await asyncio.sleep(leave_after_s)
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": []}
        await asyncio.wait_for(gateway(scope, receive, send), timeout=10)
        return next((m["status"] for m in sent if m["type"] == "http.response.start"), None)

    async def go() -> tuple[list[int | None], dict[str, float]]:
        endpoints = parse_static([f"127.0.0.1:{server.ports[0]},name=e0,leadtime.io/accelerator=h100-sxm"])
        gateway = Gateway(StaticDiscovery(endpoints), policy, GatewaySettings(scrape_interval_s=0.05))
        await gateway.start()
        try:
            for _ in range(200):
                if gateway.routable() and all(s.state is not None for s in gateway.routable()):
                    break
                await asyncio.sleep(0.02)
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                codes: list[int | None] = []
                for i in range(requests):
                    body = {"prompt": f"hello {i}", "max_tokens": 2}
                    if leave_after_s is None:
                        codes.append((await client.post("/v1/completions", json=body)).status_code)
                    else:
                        codes.append(await leaving(gateway, json.dumps(body).encode()))
                samples = parse_samples((await client.get("/metrics")).text)
        finally:
            await gateway.stop()
        counts = {
            "held": sum(v for _, v in samples.get("leadtime_router_held_seconds_count", [])),
            "held_s": sum(v for _, v in samples.get("leadtime_router_held_seconds_sum", [])),
            "policy_error": sum(
                v
                for labels, v in samples.get("leadtime_router_fallbacks_total", [])
                if labels.get("reason") == "policy_error"
            ),
            "left": sum(
                v for labels, v in samples.get("leadtime_router_requests_total", []) if labels["code"] == "499"
            ),
        }
        return codes, counts

    try:
        return asyncio.run(go())
    finally:
        server.stop()


def test_the_gateway_offers_a_held_request_again_a_scrape_later_and_counts_the_wait() -> None:
    policy = HoldsOnce()
    codes, counts = through_gateway(policy, 3)
    assert codes == [200, 200, 200]
    assert [wait > 0 for _, _, wait in policy.offers] == [False, True] * 3
    # Offered again one scrape interval (50 ms) or a little more after it came in.
    assert all(0.04 <= wait / 1e3 < 1.0 for _, _, wait in policy.offers if wait)
    assert counts["held"] == 3 and 0.12 <= counts["held_s"] < 3.0
    assert counts["policy_error"] == 0


def test_the_gateway_overrules_a_policy_that_never_places_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_app, "MAX_HOLD_MS", 200.0)
    codes, counts = through_gateway(HoldsForever(), 1)
    assert codes == [200]  # placed by the heuristics, not dropped
    assert counts["policy_error"] == 1


def test_a_client_that_leaves_while_its_request_is_held_gets_nothing_sent_anywhere() -> None:
    policy = HoldsForever()
    codes, counts = through_gateway(policy, 1, leave_after_s=0.3)
    assert codes == [None]  # no answer started: the gateway stopped as soon as the client was gone
    assert counts["left"] == 1 and counts["policy_error"] == 0
    assert counts["held"] == 1 and 0.25 <= counts["held_s"] < 2.0
