"""Heuristic routing policies, built the way llm-d's scheduler is: Filter → Scorer → Picker.

A filter narrows the candidates, each scorer gives every remaining candidate a score in [0, 1], the scores are
summed with weights, and a picker chooses. llm-d's default profile weighs prefix-cache 3, queue 2 and
KV-utilization 2; those are the defaults of `LlmdHeuristicPolicy`. On a P/D fleet the same pipeline picks the
decode endpoint and then, separately, the prefill endpoint, as llm-d does.

None of them reads a time-slice orchestrator: a vLLM engine put to sleep for another job keeps its server, its
health check and its /metrics up, so a router that only scrapes endpoints keeps offering it requests (which wait
until it wakes). `resident_filter` is the readiness filter a router that does read the orchestrator would add;
`LlmdHeuristicPolicy(ready_only=True)` is llm-d's heuristic with it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from leadtime.features.rows import is_resident
from leadtime.router_plugin.policy import Candidate, NoCandidateError, Outcome, Pick, RouteRequest, split_by_role
from leadtime.router_plugin.scorers.load import kv_utilization_scorer, prefix_cache_scorer, queue_scorer

Scorer = Callable[[RouteRequest, Sequence[Candidate]], list[float]]
Filter = Callable[[RouteRequest, Sequence[Candidate]], list[Candidate]]


def resident_filter(request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
    """Drop time-sliced endpoints that are not resident, unless that would drop them all."""
    kept = [c for c in candidates if is_resident(c.state.timeslice_state)]
    return kept or list(candidates)


@dataclass(frozen=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


class MaxScorePicker:
    """Highest weighted score; ties broken at random (seeded) so equal endpoints share the load."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def __call__(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> Candidate:
        best = max(scores)
        tied = [c for c, s in zip(candidates, scores, strict=True) if s >= best - 1e-12]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class ScoringPolicy:
    """Filters, weighted scorers and a max-score picker: the shape of every llm-d scheduling profile.

    Parameters
    ----------
    name
        Reported in results.
    scorers
        Weighted scorers; each returns one score in [0, 1] per candidate.
    filters
        Applied in order before scoring.
    seed
        Seeds the tie-breaking picker.
    """

    def __init__(
        self, name: str, scorers: Sequence[WeightedScorer], filters: Sequence[Filter] = (), seed: int = 0
    ) -> None:
        self.name = name
        self.scorers = list(scorers)
        self.filters = list(filters)
        self.picker = MaxScorePicker(seed)

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        remaining = list(candidates)
        for keep in self.filters:
            remaining = keep(request, remaining)
        if not remaining:
            raise NoCandidateError("every candidate was filtered out")
        totals = [0.0] * len(remaining)
        for weighted in self.scorers:
            for i, score in enumerate(weighted.scorer(request, remaining)):
                totals[i] += weighted.weight * score
        return self.picker(remaining, totals)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if roles.disaggregated:
            decode = self._choose(request, roles.decode)
            prefill = self._choose(request, roles.prefill)
            return Pick(prefill.endpoint_id, decode.endpoint_id)
        return Pick(self._choose(request, roles.unified).endpoint_id)

    def observe(self, outcome: Outcome) -> None:
        """Heuristics do not learn."""


class LlmdHeuristicPolicy(ScoringPolicy):
    """llm-d's default scorer weights: prefix-cache 3, queue 2, KV-utilization 2."""

    def __init__(
        self,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        seed: int = 0,
        ready_only: bool = False,
    ) -> None:
        super().__init__(
            "llmd_heuristic_ready" if ready_only else "llmd_heuristic",
            [
                WeightedScorer(prefix_cache_scorer, prefix_weight),
                WeightedScorer(queue_scorer, queue_weight),
                WeightedScorer(kv_utilization_scorer, kv_weight),
            ],
            filters=[resident_filter] if ready_only else [],
            seed=seed,
        )


class RandomPolicy:
    """Uniformly random endpoint (pair); the floor any policy must beat."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if roles.disaggregated:
            return Pick(self._rng.choice(roles.prefill).endpoint_id, self._rng.choice(roles.decode).endpoint_id)
        return Pick(self._rng.choice(roles.unified).endpoint_id)

    def observe(self, outcome: Outcome) -> None:
        """Random does not learn."""


class RoundRobinPolicy:
    """Each endpoint in turn (per role), in candidate order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def _next(self, role: str, candidates: Sequence[Candidate]) -> Candidate:
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return candidates[turn % len(candidates)]

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if roles.disaggregated:
            prefill = self._next("prefill", roles.prefill)
            decode = self._next("decode", roles.decode)
            return Pick(prefill.endpoint_id, decode.endpoint_id)
        return Pick(self._next("both", roles.unified).endpoint_id)

    def observe(self, outcome: Outcome) -> None:
        """Round-robin does not learn."""


def _load(candidate: Candidate) -> int:
    return candidate.state.num_request_waiting + candidate.state.num_request_running


class LeastQueuePolicy(ScoringPolicy):
    """Fewest requests waiting plus running (ties at random)."""

    def __init__(self, seed: int = 0) -> None:
        def least_load(request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
            loads = [_load(c) for c in candidates]
            low, high = min(loads), max(loads)
            return [1.0 if high == low else (high - q) / (high - low) for q in loads]

        super().__init__("least_queue", [WeightedScorer(least_load, 1.0)], seed=seed)
