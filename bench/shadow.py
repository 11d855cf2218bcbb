"""llm-d's predictor measured on the requests another policy routed.

Each router's prediction error is measured on the requests it routed, under the load its own choices made, and
two routers make different loads: on a P/D fleet llm-d's router keeps the decode endpoints lightly packed (their
ITL steady) while Leadtime also prefills on them (their ITL swinging with prefill chunks). To compare the two
predictors on the same requests, llm-d's predictor follows Leadtime's picks as if it had made them — its own rows
and tokens-in-flight counters, learning from the same outcomes — without changing a single decision.

Its work is done at the start of the next `observe` (or first token, or failure), not inside `pick`: the simulator
times `pick` as the policy's decision cost, and nothing that the follower reads changes between a pick and the next
of those (its model learns and its counters move only there), so the deferred predictions are the ones it would
have made at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leadtime.router_plugin.peers.llmd_predicted import LlmdPredictedPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest, RoutingPolicy, pass_on


class FollowedByLlmd:
    """`policy` routing as it would alone, with llm-d's predictor (`follower`) predicting each of its picks.

    `ttft_pairs` and `tpot_pairs` collect (actual, follower's mean prediction) per completed request.
    """

    def __init__(self, policy: RoutingPolicy, follower: LlmdPredictedPolicy) -> None:
        self.policy = policy
        self.follower = follower
        self.name = policy.name
        self.ttft_pairs: list[tuple[float, float]] = []
        self.tpot_pairs: list[tuple[float, float]] = []
        self._pending: list[tuple[RouteRequest, Sequence[Candidate], Pick]] = []
        self._predicted: dict[str, tuple[float, float]] = {}

    def attach(self, simulator: Any) -> None:
        attach = getattr(self.policy, "attach", None)
        if callable(attach):
            attach(simulator)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        pick = self.policy.pick(request, candidates)
        if not pick.hold:  # a held request is followed where it is placed
            self._pending.append((request, list(candidates), pick))
        return pick

    def observe(self, outcome: Outcome) -> None:
        self._catch_up()
        self.policy.observe(outcome)
        predicted = self._predicted.pop(outcome.request_id, None)
        self.follower.observe(outcome)
        if predicted is None:
            return
        if outcome.ttft_ms > 0:
            self.ttft_pairs.append((outcome.ttft_ms, predicted[0]))
        if outcome.output_tokens > 1 and outcome.itl_ms > 0:
            self.tpot_pairs.append((outcome.itl_ms, predicted[1]))

    def prefilled(self, request_id: str, now_ms: float) -> None:
        """The first token: the follower moves the request from its prefill to its decode count, as would the
        policy if it has the hook."""
        self._catch_up()
        pass_on(self.policy, "prefilled", request_id, now_ms)
        self.follower.prefilled(request_id, now_ms)

    def abandon(self, request_id: str) -> None:
        """The request failed: both let go of it (the policy's ledgers, the follower's counters)."""
        self._catch_up()
        pass_on(self.policy, "abandon", request_id)
        self.follower.abandon(request_id)
        self._predicted.pop(request_id, None)

    def _catch_up(self) -> None:
        for request, candidates, pick in self._pending:
            self._predicted[request.request_id] = self.follower.follow(request, candidates, pick)
        self._pending.clear()
