"""The routing-policy protocol: what a router (or the simulator) asks of any policy, and nothing more.

A policy gets the request and one `Candidate` per endpoint (the endpoint's state as last published, when it was
published, and how many of the request's prompt tokens that endpoint probably has cached) and returns a `Pick`.
On a P/D-disaggregated fleet a pick is a pair: the endpoint that prefills and the one that decodes. A pick may
carry the feature rows the policy scored and what it predicted, so that what is recorded and learned is what
was decided on. When the request completes, the caller reports an `Outcome` through `observe`; outcomes arrive
late, exactly when each request finishes, as in production.

Three hooks are optional, called only on a policy that has them (so that `RoutingPolicy` asks nothing more of the
others): `prefilled(request_id, now_ms)`, the request's first token came back (a router sees it when the stream
starts: its prefill is done, on P/D its KV transfer too), at most once and before its `observe`, for the peers
whose real routers release the prefill side then; `abandon(request_id)`, the request will not complete where it
was sent; and `forget_endpoint(endpoint_id)`, the endpoint left the fleet (discovery no longer lists it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Protocol, runtime_checkable

from leadtime.features.errors import FeatureError
from leadtime.features.rows import MAX_COUNT, EndpointState, FeatureRow, RequestFeatures, check_count, check_real

MIN_SLO_MS = 0.001
"""The smallest SLO (TTFT or ITL, ms) a request may have: a microsecond, far below any latency an endpoint
reaches. The decode-harm ledger sums 1 / ITL SLO over the requests in flight on an endpoint
(`decoding.DecodingLedger`): `1e-320` made that sum infinite, then NaN when its request completed, and every later
pick offered that endpoint raised IndexError while anything else was in flight there; `1e-300` swamped the other
requests' share of the sum, which came back negative. The gateway's SLO headers and options, the simulator's
options and a fleet's SLO classes are refused below it, naming it."""


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
    arrival_ms: float = 0.0
    """On the router's clock, the one `Candidate.published_ms` is on: now, for a request offered again."""
    held_ms: float = 0.0
    """How long the router has held the request already (`Pick.hold`). Its SLOs count from when it came in, so
    `held_ms` of its TTFT SLO is spent."""
    max_output_tokens: int | None = None
    """The client's cap on output tokens (`max_tokens`), when it gave one: an upper bound, not the output length.
    An endpoint reserves room for it (vLLM refuses a prompt plus `max_tokens` beyond its cache), so it decides
    which endpoints can hold the request (`kv_tokens`)."""

    def __post_init__(self) -> None:
        """Checked here, naming the field, rather than failing inside a scorer (`tpot_slo_ms=nan` was an IndexError
        from an empty choice, `"500"` a TypeError). An SLO of inf is none, stored as None: every policy reads None
        as no SLO, while inf, as a number, made a headroom of inf / inf (NaN) and a score equal everywhere.

        >>> RouteRequest("r", 100, ttft_slo_ms=float("nan"))
        Traceback (most recent call last):
        ...
        leadtime.features.errors.FeatureError: ttft_slo_ms: must be a number of at least 0.001 ms (inf: none), got nan
        >>> RouteRequest("r", 100, ttft_slo_ms=float("inf")).ttft_slo_ms is None
        True
        """
        check_count("input_tokens", self.input_tokens)
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            slo = getattr(self, name)
            if slo is not None and (isinstance(slo, bool) or not isinstance(slo, Real) or not float(slo) >= MIN_SLO_MS):
                raise FeatureError(name, f"must be a number of at least {MIN_SLO_MS} ms (inf: none), got {slo!r}")
            if slo is not None and math.isinf(slo):
                object.__setattr__(self, name, None)
        check_real("arrival_ms", self.arrival_ms, -math.inf)
        check_real("held_ms", self.held_ms)
        if self.max_output_tokens is not None:
            check_count("max_output_tokens", self.max_output_tokens)

    @property
    def kv_tokens(self) -> int:
        """The most KV cache the request may need on one endpoint: its prompt plus `max_output_tokens` when known,
        else its prompt alone (a router cannot know more).

        >>> RouteRequest("r", 100, max_output_tokens=20).kv_tokens, RouteRequest("r", 100).kv_tokens
        (120, 100)
        """
        return self.input_tokens + (self.max_output_tokens or 0)


@dataclass(frozen=True)
class Candidate:
    """One endpoint as the router sees it for this request.

    `published_ms` says when `state` was taken: whatever the router sent the endpoint since then is not in it.
    """

    state: EndpointState
    prefix_hit_tokens: int = 0
    published_ms: float = 0.0
    timeslice_group: str = ""
    kv_cache_tokens: int | None = None
    """How many tokens the endpoint's KV cache holds in all (vLLM's `block_size × num_gpu_blocks`), or None when it
    does not say. A fixed size, not load: it decides whether the endpoint can ever take the request
    (`candidates_that_fit`), and is no feature a predictor scores, so it is here rather than in `state`."""

    def __post_init__(self) -> None:
        """Checked when made, naming the field, as `RouteRequest` is: a string hit count failed deep inside `pick`,
        and a NaN `published_ms` switched the in-flight accounting off for the endpoint in silence."""
        if not isinstance(self.state, EndpointState):
            raise TypeError(f"state must be an EndpointState, got {type(self.state).__name__}")
        # Made for every candidate of every request: the common types are let through first (~0.1 µs, not ~1 µs).
        hits, published, kv = self.prefix_hit_tokens, self.published_ms, self.kv_cache_tokens
        if not (type(hits) is int and 0 <= hits <= MAX_COUNT):
            check_count("prefix_hit_tokens", hits)
        if not (type(published) is float and math.isfinite(published)):
            check_real("published_ms", published, -math.inf)
        if kv is not None and not (type(kv) is int and 0 <= kv <= MAX_COUNT):
            check_count("kv_cache_tokens", kv)

    @property
    def endpoint_id(self) -> str:
        return self.state.endpoint_id

    def holds(self, request: RouteRequest) -> bool:
        """Whether the endpoint's KV cache can hold `request` at all (an unknown size is taken to hold it): its
        prompt and output, or on a prefill endpoint, which hands the request on after its first token, the prompt.

        >>> request = RouteRequest("r", 1000, max_output_tokens=500)
        >>> Candidate(EndpointState("d", role="decode"), kv_cache_tokens=1200).holds(request)
        False
        >>> Candidate(EndpointState("p", role="prefill"), kv_cache_tokens=1200).holds(request)
        True
        """
        if self.kv_cache_tokens is None:
            return True
        need = request.input_tokens if self.state.role == "prefill" else request.kv_tokens
        return need <= self.kv_cache_tokens

    def row(self, request: RouteRequest) -> FeatureRow:
        """The (request, endpoint) feature row a predictor scores."""
        hits = min(self.prefix_hit_tokens, request.input_tokens)
        return FeatureRow(RequestFeatures.with_prefix_hits(request.input_tokens, hits), self.state)


@dataclass(frozen=True)
class Pick:
    """Where a request goes: one endpoint, or for P/D a prefill endpoint and a decode endpoint.

    A policy that scored feature rows may hand them back (`row` for the endpoint that prefills, `decode_row` for
    the decode endpoint) with its predictions, so that what is recorded is what it decided on; otherwise the
    caller records the candidate's row as published.

    A `held` pick places nothing: the router keeps the request and offers it again, with `RouteRequest.held_ms`
    counting, once the endpoints have published fresh state (as llm-d's flow control queues requests at the
    gateway while the pool is saturated, rather than on an endpoint).
    """

    endpoint_id: str
    decode_endpoint_id: str | None = None
    row: FeatureRow | None = None
    decode_row: FeatureRow | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    hold: bool = False

    @classmethod
    def held(cls) -> Pick:
        """Place the request later (see the class docstring)."""
        return cls("", hold=True)

    @property
    def is_pair(self) -> bool:
        return self.decode_endpoint_id is not None


@dataclass(frozen=True)
class Outcome:
    """What happened to one routed request, reported when it completes.

    `ttft_ms` is what the client saw from when the request was sent to the endpoint (on P/D it includes the KV
    transfer; a request the router held waited there before that, which is not the endpoint's doing and is not
    in it); `itl_ms` is the mean gap between
    output tokens (0 for a request that produced one token only); `completed_ms` is on the router's clock.
    """

    request_id: str
    endpoint_id: str
    decode_endpoint_id: str | None
    ttft_ms: float
    itl_ms: float
    output_tokens: int
    completed_ms: float

    def __post_init__(self) -> None:
        """Checked when it is made, naming its own fields: a bad one reported to `observe` failed after the policy
        had let go of its decision, and `output_tokens=-3` was learned from.

        >>> Outcome("r", "e", None, ttft_ms=float("nan"), itl_ms=10.0, output_tokens=5, completed_ms=0.0)
        Traceback (most recent call last):
        ...
        leadtime.features.errors.FeatureError: ttft_ms: must be finite, got nan
        """
        check_real("ttft_ms", self.ttft_ms)
        check_real("itl_ms", self.itl_ms)
        check_count("output_tokens", self.output_tokens)
        check_real("completed_ms", self.completed_ms, -math.inf)

    @property
    def learned_itl_ms(self) -> float:
        """The ITL to learn: none (0) from a request of one token, which had no gap between tokens."""
        return self.itl_ms if self.output_tokens > 1 else 0.0


@runtime_checkable
class RoutingPolicy(Protocol):
    """A routing policy: one decision method and one learning hook."""

    name: str

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        """Choose the endpoint (or P/D pair) for `request` among `candidates`."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Learn from a completed request (the policy remembers what it decided on from the request id)."""
        ...


OPTIONAL_HOOKS = ("prefilled", "abandon", "forget_endpoint")
"""The hooks a policy may have (see the module's docstring)."""


def pass_on(policy: object, hook: str, *args: object) -> None:
    """Call `policy`'s optional `hook` with `args` if it has it: what a policy wrapping another (shadow mode, a
    timing or accuracy harness) owes the one it wraps, which a router would otherwise never tell.

    >>> pass_on(object(), "abandon", "r1")  # a policy without the hook: nothing to tell
    """
    if hook not in OPTIONAL_HOOKS:
        raise ValueError(f"{hook!r} is not an optional hook of a policy ({', '.join(OPTIONAL_HOOKS)})")
    call = getattr(policy, hook, None)
    if call is not None:
        call(*args)


@dataclass(frozen=True)
class RoleSplit:
    unified: tuple[Candidate, ...]
    prefill: tuple[Candidate, ...]
    decode: tuple[Candidate, ...]

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)


def serves_clients(candidates: Sequence[Candidate]) -> bool:
    """Whether some of `candidates` can serve a client's request: any but prefill endpoints, which serve none alone.

    >>> serves_clients([])
    False
    """
    return any(c.state.role != "prefill" for c in candidates)


def split_by_role(candidates: Sequence[Candidate]) -> RoleSplit:
    """Group candidates by role; a fleet is either unified (`both`) or P/D (`prefill` + `decode`).

    Decode endpoints prefill for themselves whatever is not sent to a prefill endpoint, so without any prefill
    endpoint (the pool scaled to zero or unreachable) they serve whole requests, as a unified fleet. Prefill
    endpoints alone serve no client."""
    if not candidates:
        raise NoCandidateError("no candidate endpoints")
    unified = tuple(c for c in candidates if c.state.role == "both")
    prefill = tuple(c for c in candidates if c.state.role == "prefill")
    decode = tuple(c for c in candidates if c.state.role == "decode")
    if prefill and not decode:
        raise NoCandidateError("P/D fleet has no decode endpoint (prefill endpoints serve no client alone)")
    if decode and not prefill:
        return RoleSplit(unified + decode, (), ())
    return RoleSplit(unified, prefill, decode)


def candidates_that_fit(request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates whose KV cache can hold `request` (`Candidate.holds`): those the router offers a policy.

    An endpoint too small for a request must refuse it (vLLM answers 400, the simulator cannot run it), whatever it
    scores, so it is left out before any policy looks: every policy then picks among endpoints that can serve.
    NoCandidateError, naming the sizes, when there were candidates that could serve a client but none that can hold
    the request (on a P/D fleet, no decode endpoint can); with no candidate at all the list is returned as it is,
    for the policy to refuse as before.

    >>> big = Candidate(EndpointState("big"), kv_cache_tokens=90_000)
    >>> small = Candidate(EndpointState("small"), kv_cache_tokens=30_000)
    >>> [c.endpoint_id for c in candidates_that_fit(RouteRequest("r", 40_000), [big, small])]
    ['big']
    """
    fit = [c for c in candidates if c.holds(request)]
    if len(fit) == len(candidates) or not serves_clients(candidates) or serves_clients(fit):
        return fit
    what = "prompt plus max_tokens" if request.max_output_tokens is not None else "prompt"
    largest = max(c.kv_cache_tokens or 0 for c in candidates if c.state.role != "prefill")
    raise NoCandidateError(
        f"no endpoint's KV cache can hold the request's {request.kv_tokens:,} tokens ({what}); "
        f"the largest holds {largest:,}"
    )
