"""The clairvoyant policy: asks the simulator for every candidate's exact TTFT and takes the best.

It forks each candidate endpoint's true current state (not the stale published one), adds the request and
runs that replica forward with no further arrivals until the request's prefill completes. No predictor can
know more than this (short of knowing the future arrivals), so it is the upper reference for any predictor.
On a P/D fleet the prefill endpoint is the one with the earliest exact prefill completion, and the decode
endpoint the one whose KV link frees first, ties broken by the fewest running requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from leadtime.features.rows import Observation
from leadtime.router_plugin.policy import Candidate, Pick, RouteRequest, split_by_role
from leadtime.simulator.endpoint import SimRequest

if TYPE_CHECKING:
    from leadtime.simulator.engine import FleetSimulator


class ClairvoyantPolicy:
    """The upper reference: forks each candidate's true state to pick the lowest exact TTFT."""

    name = "clairvoyant"

    def __init__(self) -> None:
        self._sim: FleetSimulator | None = None

    def attach(self, simulator: FleetSimulator) -> None:
        """Get the simulator whose true state it reads."""
        self._sim = simulator

    def exact_ttft_ms(self, request: RouteRequest, endpoint_id: str, give_up_after_ms: float = math.inf) -> float:
        """Time from now until `request` would finish its prefill on `endpoint_id` (∞ beyond the give-up)."""
        sim = self._sim
        if sim is None:
            raise RuntimeError("the clairvoyant policy only runs inside the simulator")
        endpoint = sim.by_id[endpoint_id]
        segment_tokens = sim.routing.segment_tokens if sim.routing is not None else 512
        probe = SimRequest(-1, sim.now, request.input_tokens, 1, request.block_hashes, segment_tokens)
        return endpoint.time_to_prefill(probe, sim.now, sim.resume_time(endpoint_id), give_up_after_ms)

    def _best_prefill(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        """The exact minimum, trying lightly loaded endpoints first so that loaded ones can be cut short."""
        order = sorted(
            candidates, key=lambda c: (c.state.num_request_waiting, c.state.num_request_running, c.endpoint_id)
        )
        best, best_ms = order[0], math.inf
        for c in order:
            ttft = self.exact_ttft_ms(request, c.endpoint_id, best_ms)
            if ttft < best_ms or (ttft == best_ms and c.endpoint_id < best.endpoint_id):
                best, best_ms = c, ttft
        return best

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        """The endpoint (or P/D pair) with the lowest exact TTFT for this request."""
        roles = split_by_role(candidates)
        if not roles.disaggregated:
            return Pick(self._best_prefill(request, roles.unified).endpoint_id)
        prefill = self._best_prefill(request, roles.prefill)
        sim = self._sim
        assert sim is not None
        decode = min(
            roles.decode,
            key=lambda c: (sim.link_free_ms(c.endpoint_id), len(sim.by_id[c.endpoint_id].running), c.endpoint_id),
        )
        return Pick(prefill.endpoint_id, decode.endpoint_id)

    def observe(self, observation: Observation) -> None:
        """It already knows everything."""
