"""The routing-policy protocol: what a router (or the simulator) asks of any policy, and nothing more.

A policy gets the request and one `Candidate` per endpoint (the endpoint's state as last scraped, plus how many
of the request's prompt tokens that endpoint probably has cached) and returns a `Pick`. On a P/D-disaggregated
fleet a pick is a pair: the endpoint that prefills and the one that decodes. When the request completes, the
caller reports what happened through `observe`, so a learning policy learns as it routes; observations arrive
late, exactly when the request finishes, as in production.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures


class NoCandidateError(ValueError):
    """No endpoint can serve the request (empty fleet, or a P/D fleet missing one of the roles)."""


@dataclass(frozen=True)
class RouteRequest:
    """What a router knows of a request when it must place it.

    The output length is unknown to a real router; it is not part of the request.
    """

    request_id: str
    input_tokens: int
    block_hashes: tuple[int, ...] = ()
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None


@dataclass(frozen=True)
class Candidate:
    """One endpoint as the router sees it for this request."""

    state: EndpointState
    prefix_hit_tokens: int = 0

    @property
    def endpoint_id(self) -> str:
        return self.state.endpoint_id

    def row(self, request: RouteRequest) -> FeatureRow:
        """The (request, endpoint) feature row a predictor scores."""
        hits = min(self.prefix_hit_tokens, request.input_tokens)
        return FeatureRow(RequestFeatures.with_prefix_hits(request.input_tokens, hits), self.state)


@dataclass(frozen=True)
class Pick:
    """Where a request goes: one endpoint, or for P/D a prefill endpoint and a decode endpoint."""

    endpoint_id: str
    decode_endpoint_id: str | None = None

    @property
    def is_pair(self) -> bool:
        return self.decode_endpoint_id is not None


@runtime_checkable
class RoutingPolicy(Protocol):
    """A routing policy: one decision method and one learning hook."""

    name: str

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        """Choose the endpoint (or P/D pair) for `request` among `candidates`."""
        ...

    def observe(self, observation: Observation) -> None:
        """Learn from a completed request (the row it was routed on plus actual TTFT/ITL)."""
        ...


@dataclass(frozen=True)
class RoleSplit:
    unified: tuple[Candidate, ...]
    prefill: tuple[Candidate, ...]
    decode: tuple[Candidate, ...]

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)


def split_by_role(candidates: Sequence[Candidate]) -> RoleSplit:
    """Group candidates by role; a fleet is either unified (`both`) or P/D (`prefill` + `decode`)."""
    if not candidates:
        raise NoCandidateError("no candidate endpoints")
    unified = tuple(c for c in candidates if c.state.role == "both")
    prefill = tuple(c for c in candidates if c.state.role == "prefill")
    decode = tuple(c for c in candidates if c.state.role == "decode")
    if (prefill or decode) and not (prefill and decode):
        missing = "decode" if prefill else "prefill"
        raise NoCandidateError(f"P/D fleet has no {missing} endpoint")
    return RoleSplit(unified, prefill, decode)
