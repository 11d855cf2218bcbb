"""Learning beside another router: a plain policy routes; the predictor predicts what it picked, and learns what
happened.

To see Leadtime's predictions on a fleet before routing on them, run the gateway with a policy that does not
predict and a predictor (`leadtime route --policy round-robin --shadow --predictor-url URL`, or `--profile
heuristic` for llm-d's default scorers). Every decision stays that policy's; the endpoint it picked is predicted
(one row, within the plugin's default deadline; a prediction that fails, is late or is no number is skipped, never
the request), and when the request completes its row, what happened and what was predicted go to the predictor like
any router's observations. The service's live error and coverage (`leadtime_live_*`) and the gateway's predicted and
actual TTFT/ITL then say how well the predictor knows the fleet, and it is warm the day the gateway routes on it.

On a P/D fleet only the decode endpoint's ITL is learned: a pair's TTFT includes a KV transfer the plain policy
does not model (Leadtime's own policy subtracts the transfer it predicted before learning the prefill).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from leadtime.features.rows import FeatureRow, Observation
from leadtime.router_plugin.client import PredictorClient, PredictorError
from leadtime.router_plugin.config import DEFAULT_DEADLINE_MS
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest, RoutingPolicy, pass_on

SHADOW_DEADLINE_S = DEFAULT_DEADLINE_MS / 1e3
"""As the plugin's default `fallback.deadlineMs`."""


@dataclass
class ShadowCounters:
    predicted: int = 0
    unpredicted: int = 0
    """Decisions whose pick could not be predicted in time (learned without a prediction)."""
    learned: int = 0
    unreported: int = 0


@dataclass(frozen=True)
class _Shadowed:
    row: FeatureRow
    pair: bool
    ttft_ms: float | None = None
    ttft_quantile_ms: float | None = None
    tpot_ms: float | None = None
    tpot_quantile_ms: float | None = None


class ShadowLearning:
    """`baseline` routes; `predictor` predicts its picks and learns their outcomes.

    >>> from leadtime.features.rows import EndpointState
    >>> from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
    >>> from leadtime.router_plugin.client import InProcessPredictor
    >>> from leadtime.router_plugin.heuristics import RoundRobinPolicy
    >>> predictor = InProcessPredictor(OnlinePredictor(LearnerConfig(background=False)))
    >>> shadow = ShadowLearning(RoundRobinPolicy(), predictor)
    >>> candidates = [Candidate(EndpointState("a", "h100-sxm")), Candidate(EndpointState("b", "h100-sxm"))]
    >>> pick = shadow.pick(RouteRequest("r1", input_tokens=500), candidates)
    >>> pick.endpoint_id, pick.predicted_ttft_ms is not None  # round-robin's pick, predicted
    ('a', True)
    >>> shadow.observe(Outcome("r1", "a", None, ttft_ms=120.0, itl_ms=11.0, output_tokens=8, completed_ms=900.0))
    >>> shadow.shadow_counters.learned
    1
    """

    def __init__(
        self, baseline: RoutingPolicy, predictor: PredictorClient, deadline_s: float | None = SHADOW_DEADLINE_S
    ) -> None:
        self.baseline = baseline
        self.predictor = predictor
        self.deadline_s = deadline_s
        self.name = f"{getattr(baseline, 'name', 'policy')}_shadow"
        self.shadow_counters = ShadowCounters()
        self._decisions: dict[str, _Shadowed] = {}

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        pick = self.baseline.pick(request, candidates)
        if pick.hold:
            return pick
        pair = pick.is_pair
        chosen = pick.decode_endpoint_id if pick.decode_endpoint_id is not None else pick.endpoint_id
        candidate = next(c for c in candidates if c.endpoint_id == chosen)
        row = candidate.row(request)
        try:
            # Checked as the Leadtime policy checks its answers: a NaN or an overflow reported with the outcome
            # would be refused then, and the outcome lost with it.
            p = self.predictor.predict([row], self.deadline_s).check_rows(1, "the answer").check_finite("the answer")
        except PredictorError:
            self.shadow_counters.unpredicted += 1
            self._decisions[request.request_id] = _Shadowed(row, pair)
            return dataclasses.replace(pick, decode_row=row) if pair else dataclasses.replace(pick, row=row)
        self.shadow_counters.predicted += 1
        tpot, tpot_q = float(p.tpot_mean_ms[0]), float(p.tpot_quantile_ms[0])
        if pair:
            self._decisions[request.request_id] = _Shadowed(row, True, tpot_ms=tpot, tpot_quantile_ms=tpot_q)
            return dataclasses.replace(pick, decode_row=row, predicted_tpot_ms=tpot)
        ttft, ttft_q = float(p.ttft_mean_ms[0]), float(p.ttft_quantile_ms[0])
        self._decisions[request.request_id] = _Shadowed(row, False, ttft, ttft_q, tpot, tpot_q)
        return dataclasses.replace(pick, row=row, predicted_ttft_ms=ttft, predicted_tpot_ms=tpot)

    def observe(self, outcome: Outcome) -> None:
        self.baseline.observe(outcome)
        decision = self._decisions.pop(outcome.request_id, None)
        if decision is None:
            return
        itl = outcome.learned_itl_ms
        stamp = outcome.completed_ms / 1e3
        if decision.pair:
            if not itl:
                return
            observed = Observation(
                decision.row, 0.0, itl, None, decision.tpot_ms, stamp, None, decision.tpot_quantile_ms
            )
        else:
            observed = Observation.of_request(
                decision.row,
                outcome.ttft_ms,
                itl,
                stamp,
                decision.ttft_ms,
                decision.ttft_quantile_ms,
                decision.tpot_ms,
                decision.tpot_quantile_ms,
            )
        try:
            self.shadow_counters.learned += self.predictor.observe([observed], self.deadline_s)
        except PredictorError:
            self.shadow_counters.unreported += 1

    def abandon(self, request_id: str) -> None:
        """The request will not complete where it was sent: nothing to learn."""
        self._decisions.pop(request_id, None)
        pass_on(self.baseline, "abandon", request_id)

    def prefilled(self, request_id: str, now_ms: float) -> None:
        """Passed on to the baseline when it has the hook (`policy`'s optional hooks): a router calls it only on a
        policy that has it, and wrapped, a peer that releases the prefill side then never would."""
        pass_on(self.baseline, "prefilled", request_id, now_ms)

    def forget_endpoint(self, endpoint_id: str) -> None:
        """Passed on to the baseline when it has the hook, as `prefilled`."""
        pass_on(self.baseline, "forget_endpoint", endpoint_id)
