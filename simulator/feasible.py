"""Which requests any router could serve in time at all, and so the goodput no policy can pass.

A request is out of every router's reach when it would miss an SLO even with the fleet to itself: alone on
the fastest endpoint that has joined by its arrival, with every prompt segment that any earlier request carried
already cached there. Its TTFT is then its own uncached prefill, chunked by the endpoint's token budget at the
endpoint's speed (plus the KV transfer when a prefill endpoint hands it to a decode one); its ITL the step of it
decoding alone. No queue, no other batch, no swap-out and no cache miss can make it faster, so the goodput of
the requests that pass both (`ceiling_goodput_rps`) bounds every policy's, the clairvoyant's included.

It is a bound at the endpoints' mean step speed: the step noise has mean 1, and a prefill of several steps
averages it out, but a single lucky step can be a few percent faster. And it is loose where the fleet is short
of capacity: it knows nothing of the queues that other requests build. Where a routing target asks for more than
the bound allows, no router meets it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from leadtime.features.roofline import kv_transfer_ms
from leadtime.simulator.endpoint import Endpoint
from leadtime.simulator.engine import build_endpoints, join_ms
from leadtime.simulator.fleet import Fleet
from leadtime.simulator.workload import WorkloadRequest


@dataclass(frozen=True)
class _Fastest:
    """The fastest endpoint of one kind (same hardware, model, role, token budget and join time)."""

    endpoint: Endpoint
    role: str
    joins_ms: float
    transfer_ms_per_token: float  # KV handed to a decode endpoint (prefill endpoints only)


def _fastest_of_each_kind(fleet: Fleet, workload: Sequence[WorkloadRequest], seed: int) -> list[_Fastest]:
    configs = {c.endpoint_id: c for c in fleet.endpoints}
    transfer_ms_per_token = _cheapest_transfer_ms_per_token(fleet)
    best: dict[tuple[object, ...], _Fastest] = {}
    for e in build_endpoints(fleet, seed=seed):
        c = configs[e.endpoint_id]
        joins = join_ms(c, workload)
        kind = (c.accelerator, c.model, c.tensor_parallel, c.cuda_graphs, c.max_batched_tokens, c.role, joins)
        if kind in best and best[kind].endpoint.noise.speed <= e.noise.speed:
            continue
        per_token = transfer_ms_per_token if c.role == "prefill" else 0.0
        best[kind] = _Fastest(e, c.role, joins, per_token)
    return list(best.values())


def _cheapest_transfer_ms_per_token(fleet: Fleet) -> float:
    """The KV transfer of one prompt token into the decode endpoint it costs least to reach: the simulator times
    a transfer by the receiving endpoint's model and tensor-parallel degree, and no router does better than the
    cheapest."""
    return min(
        (
            kv_transfer_ms(fleet.catalog.model(c.model), 1.0, fleet.kv_link_gb_s, c.tensor_parallel)
            for c in fleet.endpoints
            if c.role == "decode"
        ),
        default=0.0,
    )


def _prefill_alone_ms(endpoint: Endpoint, input_tokens: int, cached_tokens: int) -> float:
    """The request's prefill with nothing else on the endpoint: chunks of the token budget after its cached prefix."""
    total, done = 0.0, cached_tokens
    while done < input_tokens:
        chunk = min(endpoint.max_batched_tokens, input_tokens - done)
        total += endpoint.stepper.step_ms([(chunk, done)], 0, 0.0)
        done += chunk
    return total * endpoint.noise.speed


def _best_cached_tokens(request: WorkloadRequest, seen: set[int]) -> int:
    """The longest prefix of the request's segments that some earlier request carried (its last token is always
    computed, as the engine computes it)."""
    usable = min(len(request.segments), request.input_tokens // request.segment_tokens) if request.segments else 0
    matched = 0
    while matched < usable and request.segments[matched] in seen:
        matched += 1
    if matched and matched * request.segment_tokens >= request.input_tokens:
        matched -= 1
    return matched * request.segment_tokens


def servable_alone(
    fleet: Fleet,
    workload: Sequence[WorkloadRequest],
    seed: int = 0,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> list[bool]:
    """For each request of `workload` (in order), whether it would meet both of its SLOs with the fleet to itself.

    The SLOs are the fleet's classes, or the defaults given, as the simulator assigns them; `seed` draws the
    endpoints' speeds as the simulator does.
    """
    kinds = _fastest_of_each_kind(fleet, workload, seed)
    default_ttft = ttft_slo_ms if ttft_slo_ms is not None else math.inf
    default_itl = tpot_slo_ms if tpot_slo_ms is not None else math.inf
    seen: set[int] = set()
    out = []
    for rid, request in enumerate(workload):
        ttft_slo, itl_slo = fleet.slo_of(rid, default_ttft, default_itl)
        cached = _best_cached_tokens(request, seen)
        seen.update(request.segments)
        here = [k for k in kinds if k.joins_ms <= request.arrival_ms]
        ttft = min(
            (
                _prefill_alone_ms(k.endpoint, request.input_tokens, cached)
                + k.transfer_ms_per_token * request.input_tokens
                for k in here
            ),
            default=math.inf,
        )
        itl = min(
            (k.endpoint.itl_lower_bound_ms(request.input_tokens) for k in here if k.role != "prefill"), default=math.inf
        )
        out.append(ttft <= ttft_slo and (request.output_tokens <= 1 or itl <= itl_slo))
    return out


def ceiling_goodput_rps(
    fleet: Fleet,
    workload: Sequence[WorkloadRequest],
    seed: int = 0,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> float:
    """Goodput if every request that could meet its SLOs alone did: no policy's goodput exceeds it.

    Counted per second of the arrival window, as `SimResult.goodput_rps` counts.
    """
    if not workload:
        return 0.0
    span_s = (workload[-1].arrival_ms - workload[0].arrival_ms) / 1e3
    return sum(servable_alone(fleet, workload, seed, ttft_slo_ms, tpot_slo_ms)) / max(span_s, 1e-9)
