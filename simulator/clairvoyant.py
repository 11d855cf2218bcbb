"""The clairvoyant policy: the candidate whose exact TTFT and ITL leave the most slack against the request's SLOs.

For every candidate it forks that endpoint's true current state (not the stale published one), adds the
request and runs the replica forward with no further arrivals until the request's prefill completes: that is
the request's exact TTFT there, waiting for a parked time-sliced endpoint to resume included, and so is a
resident one being handed to the other job at its next swap (it then stays away for the mean away time, the
one figure not drawn yet). The fork is then
exactly the batch the request would join; the decode step time of that batch with the request in it (the
step-time model's `decode_affine`, times the endpoint's speed) is its ITL, plus the mean away time spread over
its output tokens if the next swap falls while it decodes (it knows the output length). No router can know
more than this short of knowing future arrivals, so it is the upper reference for any predictor.

The pick maximises the smaller relative slack, min(1 − TTFT / TTFT SLO, 1 − ITL / ITL SLO): among the candidates
that meet both SLOs the one with the most slack, and when none does the one that misses by the least (misses by the
SLO itself or more are not told apart, see below). On a P/D fleet it chooses jointly over (prefill, decode) pairs,
and over decode endpoints prefilling locally: TTFT = exact prefill on the prefill endpoint + the KV transfer over
the decode endpoint's link, queued behind what is on it already; ITL = the decode endpoint's joining step, counting
the requests already bound to it whose KV has not arrived yet.

Keeping it cheap: each candidate first gets an upper bound on its slack from cheap lower bounds on its TTFT
(the step in flight, a resume, and the request's own uncached prefill at the fastest step noise) and ITL (the
request decoding alone); candidates are tried best bound first, and the search stops when no bound left beats
the best slack found. A fork is cut short once its TTFT alone rules it out, and none runs past twice the
request's TTFT SLO: a request that misses by the SLO itself or more everywhere is lost wherever it goes, and goes
where its bounds are best (on P/D, if no option is within the horizon, to the prefill and decode endpoints with the
fewest requests waiting), not to the exact smallest miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


HORIZON_SLOS = 2.0
"""Misses by the SLO itself or more are not told apart exactly (see `_floor`)."""


def _floor(ttft_slo_ms: float | None, itl_slo_ms: float | None) -> float:
    """The slack below which candidates are not told apart: a latency of `HORIZON_SLOS` times its SLO.

    Under overload every queue is deep, and forking each one to the end for every request made a run quadratic
    in the queue: 6.6 minutes of CPU for the mixed fleet's 3,000 requests at 1.5x the base load (45 s with this
    horizon), and the homogeneous fleet's had not finished after 12 minutes on a shared machine (5.4 minutes of CPU
    with a horizon of ten SLOs, 85 s with two). A request that misses by the SLO itself or more everywhere is lost
    wherever it goes; it goes where its slack's upper bound is highest (the least TTFT lower bound, i.e. the least
    prefill queued), with no fork run past the horizon.
    """
    return 1.0 - HORIZON_SLOS if ttft_slo_ms is not None or itl_slo_ms is not None else -math.inf


def _ttft_bound_ms(best: float, ttft_slo_ms: float | None, itl_slo_ms: float | None) -> float:
    """The TTFT beyond which a candidate cannot beat slack `best` (so its fork can stop there).

    >>> _ttft_bound_ms(_floor(2000.0, 100.0), 2000.0, 100.0), _ttft_bound_ms(0.25, 2000.0, 100.0)
    (4000.0, 1500.0)
    """
    if not math.isfinite(best):
        return math.inf
    if ttft_slo_ms is not None:
        return ttft_slo_ms * (1.0 - best)
    return math.inf if itl_slo_ms is not None else -best * 1e3


def _lightest_first(candidates: Sequence[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.state.num_request_waiting, c.state.num_request_running, c.endpoint_id))


class ClairvoyantPolicy:
    """The upper reference: forks each candidate's true state to pick the lowest exact TTFT."""

    name = "clairvoyant"

    def __init__(self) -> None:
        self._sim: FleetSimulator | None = None
        self._bound: dict[str, dict[int, int]] = {}
        """decode endpoint → {request id: prompt tokens} of the requests sent there that have not completed."""
        self._decode_of: dict[int, str] = {}

    def attach(self, simulator: FleetSimulator) -> None:
        """Get the simulator whose true state it reads."""
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
        park = sim.park_time(endpoint_id)
        return endpoint.fork_until_prefilled(
            self._probe(request),
            sim.now,
            sim.resume_time(endpoint_id),
            give_up_after_ms,
            park[0] if park is not None else None,
            park[1] if park is not None else 0.0,
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
        itl = fork.joining_step_ms(request.input_tokens, also)
        sim = self._simulator()
        park = sim.park_time(endpoint_id)
        tokens = sim.routing.output_tokens if sim.routing is not None else 1
        if park is not None and tokens > 1 and sim.now + ttft < park[0] < sim.now + ttft + (tokens - 1) * itl:
            itl += park[1] / (tokens - 1)  # handed to the other job while it decodes: it waits that long once
        return Estimate(ttft, itl)

    def decode_itl_ms(self, request: RouteRequest, endpoint_id: str) -> float:
        """ITL of `request` on a decode endpoint it reaches by KV transfer (the batch it would join there)."""
        endpoint = self._simulator().by_id[endpoint_id]
        return endpoint.joining_step_ms(request.input_tokens, self._in_transit(endpoint_id))

    def transfer_done_ms(self, request: RouteRequest, decode_id: str, prefill_done_ms: float) -> float:
        """When the KV lands on `decode_id` if the prefill ends `prefill_done_ms` from now (ms from now)."""
        sim = self._simulator()
        decode = sim.configs[decode_id]
        model = sim.fleet.catalog.model(decode.model)
        start = max(sim.now + prefill_done_ms, sim.link_free_ms(decode_id))
        transfer = kv_transfer_ms(model, request.input_tokens, sim.fleet.kv_link_gb_s, decode.tensor_parallel)
        return start + transfer - sim.now

    def _upper_slack(self, request: RouteRequest, endpoint_id: str, itl_ms: float | None = None) -> float:
        """No candidate's slack exceeds the slack of its cheap lower bounds (TTFT; ITL unless given)."""
        sim = self._simulator()
        endpoint = sim.by_id[endpoint_id]
        ttft = endpoint.ttft_lower_bound_ms(self._probe(request), sim.now, sim.resume_time(endpoint_id))
        itl = endpoint.itl_lower_bound_ms(request.input_tokens) if itl_ms is None else itl_ms
        return slack(Estimate(ttft, itl), request.ttft_slo_ms, request.tpot_slo_ms)

    def _cannot_win(self, request: RouteRequest, endpoint_id: str, give_up_ms: float, best_slack: float) -> bool:
        """True if the candidate can beat `best_slack` neither by TTFT (past `give_up_ms`) nor, prefilled in
        time, by ITL (the requests sure to be still running then make its batch too slow)."""
        sim = self._simulator()
        itl = sim.by_id[endpoint_id].sure_joining_step_ms(request.input_tokens, sim.now, give_up_ms)
        return slack(Estimate(0.0, itl), None, request.tpot_slo_ms) <= best_slack if request.tpot_slo_ms else False

    def _best_unified(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        ttft_slo, itl_slo = request.ttft_slo_ms, request.tpot_slo_ms
        bounds = sorted(
            ((self._upper_slack(request, c.endpoint_id), c) for c in candidates),
            key=lambda item: (-item[0], item[1].endpoint_id),
        )
        best, best_slack = None, -math.inf
        floor = _floor(ttft_slo, itl_slo)
        for upper, c in bounds:
            if upper <= max(best_slack, floor):
                break  # sorted by bound: no candidate left can beat the best (or get above the floor)
            give_up = _ttft_bound_ms(max(best_slack, floor), ttft_slo, itl_slo)
            if best is not None and self._cannot_win(request, c.endpoint_id, give_up, best_slack):
                continue
            estimate = self.estimate(request, c.endpoint_id, give_up)
            if estimate is None:
                continue
            s = slack(estimate, ttft_slo, itl_slo)
            if best is None or s > best_slack:
                best, best_slack = c, s
        return best if best is not None else bounds[0][1]

    def _best_pair(self, request: RouteRequest, prefill: Sequence[Candidate], decode: Sequence[Candidate]) -> Pick:
        sim = self._simulator()
        ttft_slo, itl_slo = request.ttft_slo_ms, request.tpot_slo_ms
        decode_itl = {d.endpoint_id: self.decode_itl_ms(request, d.endpoint_id) for d in decode}
        probe = self._probe(request)
        # Options: ("pair", p) prefills on p and decodes on the best decode endpoint for it; ("local", d) prefills
        # on d itself. Each with an upper bound on its slack, tried best bound first.
        options: list[tuple[float, str, str]] = []
        for p in prefill:
            low = sim.by_id[p.endpoint_id].ttft_lower_bound_ms(probe, sim.now, sim.resume_time(p.endpoint_id))
            upper = max(
                slack(Estimate(self.transfer_done_ms(request, d, low), decode_itl[d]), ttft_slo, itl_slo)
                for d in decode_itl
            )
            options.append((upper, "pair", p.endpoint_id))
        for c in decode:
            options.append((self._upper_slack(request, c.endpoint_id), "local", c.endpoint_id))
        options.sort(key=lambda o: (-o[0], o[1], o[2]))
        best: Pick | None = None
        best_slack = -math.inf
        floor = _floor(ttft_slo, itl_slo)
        for upper, kind, endpoint_id in options:
            if upper <= max(best_slack, floor):
                break
            give_up = _ttft_bound_ms(max(best_slack, floor), ttft_slo, itl_slo)
            if kind == "local":
                if best is not None and self._cannot_win(request, endpoint_id, give_up, best_slack):
                    continue
                estimate = self.estimate(request, endpoint_id, give_up)
                if estimate is not None and (best is None or slack(estimate, ttft_slo, itl_slo) > best_slack):
                    best, best_slack = Pick(endpoint_id), slack(estimate, ttft_slo, itl_slo)
                continue
            prefill_ms, _ = self._fork(request, endpoint_id, give_up)
            if not math.isfinite(prefill_ms):
                continue
            for d, itl in decode_itl.items():
                s = slack(Estimate(self.transfer_done_ms(request, d, prefill_ms), itl), ttft_slo, itl_slo)
                if best is None or s > best_slack:
                    best, best_slack = Pick(endpoint_id, d), s
        if best is None:
            return Pick(_lightest_first(prefill)[0].endpoint_id, _lightest_first(decode)[0].endpoint_id)
        return best

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        """The endpoint (or P/D pair) with the lowest exact TTFT for this request."""
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
