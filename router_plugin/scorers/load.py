"""llm-d's heuristic scorers: prefix-cache hit share, waiting queue, free KV cache; each in [0, 1] per candidate.

Each looks at one published signal and knows nothing of the others; llm-d sums them with weights (3/2/2 by
default). They are also what the Leadtime plugin falls back to when the predictor cannot answer in time.
"""

from __future__ import annotations

from collections.abc import Sequence

from leadtime.router_plugin.policy import Candidate, RouteRequest

__all__ = ["kv_utilization_scorer", "prefix_cache_scorer", "queue_scorer"]


def prefix_cache_scorer(request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
    """Share of the prompt the endpoint already holds."""
    if request.input_tokens <= 0:
        return [0.0] * len(candidates)
    return [min(c.prefix_hit_tokens, request.input_tokens) / request.input_tokens for c in candidates]


def queue_scorer(request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
    """Waiting queue, min-max normalised over the candidates: the shortest queue scores 1 (all equal: 1)."""
    queues = [c.state.num_request_waiting for c in candidates]
    low, high = min(queues), max(queues)
    if high == low:
        return [1.0] * len(candidates)
    return [(high - q) / (high - low) for q in queues]


def kv_utilization_scorer(request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
    """Free share of the KV cache."""
    return [1.0 - c.state.kv_cache_percentage for c in candidates]
