"""The clairvoyant policy: the candidate whose exact TTFT and ITL leave the most slack against the request's SLOs.

For every candidate it forks that endpoint's true current state (not the stale published one), adds the
request and runs the replica forward with no further arrivals until the request's prefill completes: that is
the request's exact TTFT there, waiting for a parked time-sliced endpoint to resume included. The fork is then
exactly the batch the request would join; the decode step time of that batch with the request in it (the
step-time model's `decode_affine`, times the endpoint's speed) is its ITL. No router can know more than this
short of knowing future arrivals, so it is the upper reference for any predictor.

The pick maximises the smaller relative slack, min(1 − TTFT / TTFT SLO, 1 − ITL / ITL SLO): among the
candidates that meet both SLOs the one with the most slack, and when none does the one that misses by the
least. On a P/D fleet it chooses jointly over (prefill, decode) pairs, and over decode endpoints prefilling
locally: TTFT = exact prefill on the prefill endpoint + the KV transfer over the decode endpoint's link, queued
behind what is on it already; ITL = the decode endpoint's joining step, counting the requests already bound to
it whose KV has not arrived yet.

Forks of loaded endpoints are cut short once their TTFT alone rules them out against the best candidate found
so far (endpoints are tried lightest first, so that the cut comes early).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from leadtime.features.catalog import get_model
from leadtime.features.roofline import kv_transfer_ms
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest, split_by_role
from leadtime.simulator.endpoint import Endpoint, SimRequest

if TYPE_CHECKING:
    from leadtime.simulator.engine import FleetSimulator


@dataclass(frozen=True)
class Estimate:
    """A candidate's exact latencies for the request (TTFT from now, ITL of the batch it joins)."""

    ttft_ms: float
    itl_ms: float


def slack(estimate: Estimate, ttft_slo_ms: float | None, itl_slo_ms: float | None) -> float:
    """The smaller relative slack against the SLOs (< 0: a miss); with no SLO, minus the TTFT in seconds.

    >>> slack(Estimate(500.0, 20.0), 1000.0, 100.0)  # 50 % of the TTFT budget left, 80 % of the ITL budget
    0.5
    >>> slack(Estimate(3000.0, 20.0), 1000.0, 100.0)  # misses the TTFT SLO by twice its size
    -2.0
    """
    terms = []
    if ttft_slo_ms is not None:
        terms.append(1.0 - estimate.ttft_ms / ttft_slo_ms)
    if itl_slo_ms is not None:
        terms.append(1.0 - estimate.itl_ms / itl_slo_ms)
    return min(terms) if terms else -estimate.ttft_ms / 1e3


def _ttft_bound_ms(best: float, ttft_slo_ms: float | None, itl_slo_ms: float | None) -> float:
    """The TTFT beyond which a candidate cannot beat slack `best` (so its fork can stop there)."""
    if not math.isfinite(best):
        return math.inf
    if ttft_slo_ms is not None:
        return ttft_slo_ms * (1.0 - best)
    return math.inf if itl_slo_ms is not None else -best * 1e3


def _lightest_first(candidates: Sequence[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.state.num_request_waiting, c.state.num_request_running, c.endpoint_id))


class ClairvoyantPolicy:
    name = "clairvoyant"

    def __init__(self) -> None:
        self._sim: FleetSimulator | None = None
        self._bound: dict[str, dict[int, int]] = {}
        """decode endpoint → {request id: prompt tokens} of the requests sent there that have not completed."""
        self._decode_of: dict[int, str] = {}

    def attach(self, simulator: FleetSimulator) -> None:
        self._sim = simulator

    def _simulator(self) -> FleetSimulator:
        if self._sim is None:
            raise RuntimeError("the clairvoyant policy only runs inside the simulator")
        return self._sim

    def _probe(self, request: RouteRequest) -> SimRequest:
        sim = self._simulator()
        segment_tokens = sim.routing.segment_tokens if sim.routing is not None else 512
        return SimRequest(-1, sim.now, request.input_tokens, 1, request.block_hashes, segment_tokens)

    def _fork(
        self, request: RouteRequest, endpoint_id: str, give_up_after_ms: float = math.inf
    ) -> tuple[float, Endpoint | None]:
        sim = self._simulator()
        endpoint = sim.by_id[endpoint_id]
        return endpoint.fork_until_prefilled(
            self._probe(request), sim.now, sim.resume_time(endpoint_id), give_up_after_ms
        )

    def exact_ttft_ms(self, request: RouteRequest, endpoint_id: str, give_up_after_ms: float = math.inf) -> float:
        """Time from now until `request` would finish its prefill on `endpoint_id` (∞ beyond the give-up)."""
        return self._fork(request, endpoint_id, give_up_after_ms)[0]

    def _in_transit(self, endpoint_id: str) -> list[int]:
        """Prompt tokens of the requests bound to a decode endpoint that are not on it yet."""
        bound = self._bound.get(endpoint_id)
        if not bound:
            return []
        endpoint = self._simulator().by_id[endpoint_id]
        present = {r.rid for r in (*endpoint.running, *endpoint.waiting)}
        return [tokens for rid, tokens in bound.items() if rid not in present]

    def estimate(self, request: RouteRequest, endpoint_id: str, give_up_after_ms: float = math.inf) -> Estimate | None:
        """Exact TTFT and ITL if `request` were sent (and prefilled) there; None once its TTFT passes the give-up."""
        ttft, fork = self._fork(request, endpoint_id, give_up_after_ms)
        if fork is None:
            return None
        also = self._in_transit(endpoint_id) if fork.role == "decode" else []
        return Estimate(ttft, fork.joining_step_ms(request.input_tokens, also))

    def decode_itl_ms(self, request: RouteRequest, endpoint_id: str) -> float:
        """ITL of `request` on a decode endpoint it reaches by KV transfer (the batch it would join there)."""
        endpoint = self._simulator().by_id[endpoint_id]
        return endpoint.joining_step_ms(request.input_tokens, self._in_transit(endpoint_id))

    def transfer_done_ms(self, request: RouteRequest, decode_id: str, prefill_done_ms: float) -> float:
        """When the KV lands on `decode_id` if the prefill ends `prefill_done_ms` from now (ms from now)."""
        sim = self._simulator()
        model = get_model(sim.configs[decode_id].model)
        start = max(sim.now + prefill_done_ms, sim.link_free_ms(decode_id))
        return start + kv_transfer_ms(model, request.input_tokens, sim.fleet.kv_link_gb_s) - sim.now

    def _best_unified(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        ttft_slo, itl_slo = request.ttft_slo_ms, request.tpot_slo_ms
        best, best_slack = None, -math.inf
        for c in _lightest_first(candidates):
            estimate = self.estimate(request, c.endpoint_id, _ttft_bound_ms(best_slack, ttft_slo, itl_slo))
            if estimate is None:
                continue
            s = slack(estimate, ttft_slo, itl_slo)
            if best is None or s > best_slack:
                best, best_slack = c, s
        return best if best is not None else _lightest_first(candidates)[0]

    def _best_pair(self, request: RouteRequest, prefill: Sequence[Candidate], decode: Sequence[Candidate]) -> Pick:
        ttft_slo, itl_slo = request.ttft_slo_ms, request.tpot_slo_ms
        decode_itl = {d.endpoint_id: self.decode_itl_ms(request, d.endpoint_id) for d in decode}
        best: Pick | None = None
        best_slack = -math.inf
        for p in _lightest_first(prefill):
            prefill_ms, _ = self._fork(request, p.endpoint_id, _ttft_bound_ms(best_slack, ttft_slo, itl_slo))
            if not math.isfinite(prefill_ms):
                continue
            for d in decode:
                ttft = self.transfer_done_ms(request, d.endpoint_id, prefill_ms)
                s = slack(Estimate(ttft, decode_itl[d.endpoint_id]), ttft_slo, itl_slo)
                if best is None or s > best_slack:
                    best, best_slack = Pick(p.endpoint_id, d.endpoint_id), s
        for d in _lightest_first(decode):  # or no disaggregation: the decode endpoint prefills itself
            estimate = self.estimate(request, d.endpoint_id, _ttft_bound_ms(best_slack, ttft_slo, itl_slo))
            if estimate is None:
                continue
            s = slack(estimate, ttft_slo, itl_slo)
            if best is None or s > best_slack:
                best, best_slack = Pick(d.endpoint_id), s
        if best is None:
            return Pick(_lightest_first(prefill)[0].endpoint_id, _lightest_first(decode)[0].endpoint_id)
        return best

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if not roles.disaggregated:
            return Pick(self._best_unified(request, roles.unified).endpoint_id)
        pick = self._best_pair(request, roles.prefill, roles.decode)
        decode_id = pick.decode_endpoint_id or pick.endpoint_id
        rid = int(request.request_id)
        self._bound.setdefault(decode_id, {})[rid] = request.input_tokens
        self._decode_of[rid] = decode_id
        return pick

    def observe(self, outcome: Outcome) -> None:
        """It knows everything already; it only forgets which decode endpoint a completed request was bound to."""
        rid = int(outcome.request_id)
        decode_id = self._decode_of.pop(rid, None)
        if decode_id is not None:
            self._bound.get(decode_id, {}).pop(rid, None)
