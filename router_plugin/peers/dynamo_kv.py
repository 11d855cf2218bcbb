"""Dynamo's KV-aware router, re-implemented from its documentation.

Source: NVIDIA Dynamo's documentation, "KV Cache Routing" (the KV router's cost function) and the router's
options (`--kv-overlap-score-weight`, default 1.0; `--router-temperature`, default 0; `--kv-cache-block-size`). Dynamo's
router learns each worker's cache from the engines' KV events (stored / removed blocks), which makes its view
of the cache near exact, and tracks the sequences it has itself sent to each worker until they complete. For
every worker it computes a cost

    cost = overlap_score_weight × prefill_blocks + decode_blocks

where `prefill_blocks` is what the request would have to compute there (its tokens minus the tokens the worker
already caches, in blocks) and `decode_blocks` the blocks of the active sequences on that worker, the new
request's own included (a block that several active sequences share is counted once). A softmax over the
negated costs picks the worker; at temperature 0 (the default) that is the lowest cost, ties at random.

Here the cached overlap is `Candidate.prefix_hit_tokens` (the simulator publishes the engine's true cache, as
KV events would) and "until they complete" is the `Outcome` of each request, or its `abandon` when it fails
(Dynamo frees a sequence whose request errored as well). Dynamo's implementation also adds to `prefill_blocks`
the prompt tokens of requests it routed to the worker whose first token has not come back; that term is not in
the documented formula and is left out here.

P/D (Dynamo's disaggregated serving): prefill workers and decode workers register as separate pools and the
frontend places each request on one of each, the prefill worker by this same KV cost over the prefill pool
(overlap with its cache, blocks of the sequences active there) and the decode worker by the cost over the
decode pool; the KV then moves from one to the other. The prefill router frees the sequence on the prefill
worker once its prefill is done, so only prefills in flight weigh there: here when the request's first token
comes back (`prefilled`), which on P/D is after the KV transfer too. Older Dynamo releases also had conditional
disaggregation (prefill on the decode worker when the uncached prompt is at most `max_local_prefill_length`
tokens); `max_local_prefill_tokens` turns that on, off by default as in current releases.

Time-slicing: it reads no time-slice orchestrator (a sleeping vLLM engine still answers its health check and
/metrics), so it may route to an endpoint whose accelerators another job holds; the requests wait there.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from leadtime.router_plugin.policy import Candidate, NoCandidateError, Outcome, Pick, RouteRequest, split_by_role

DEFAULT_BLOCK_SIZE = 16


@dataclass
class ActiveBlocks:
    """The sequences the router has sent to one worker and not yet seen complete, as blocks.

    Prompt segments named by a hash are counted once however many active sequences share them; the rest of a
    prompt (or a prompt with no hashes) counts as its own tokens.
    """

    shared: dict[int, list[float]] = field(default_factory=dict)
    """hash → [reference count, tokens of that segment]."""
    private_tokens: float = 0.0
    shared_tokens: float = 0.0
    sequences: int = 0
    """How many are active: the sums above are taken back by subtraction, and rounding (segments that are not whole
    tokens, or prompts near 2**53 tokens) left a worker whose sequences had all completed with blocks active."""

    @property
    def tokens(self) -> float:
        return self.shared_tokens + self.private_tokens

    def new_tokens(self, request: RouteRequest) -> float:
        """Tokens `request` would add here (its segments already active elsewhere on this worker count once)."""
        per_segment, tail = _split(request)
        fresh = sum(1 for h in request.block_hashes if h not in self.shared)
        return fresh * per_segment + tail

    def add(self, request: RouteRequest) -> None:
        per_segment, tail = _split(request)
        for h in request.block_hashes:
            entry = self.shared.get(h)
            if entry is None:
                self.shared[h] = [1.0, per_segment]
                self.shared_tokens += per_segment
            else:
                entry[0] += 1
        self.private_tokens += tail
        self.sequences += 1

    def remove(self, request: RouteRequest) -> None:
        per_segment, tail = _split(request)
        for h in request.block_hashes:
            entry = self.shared.get(h)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] <= 0:
                self.shared_tokens -= entry[1]
                del self.shared[h]
        self.private_tokens = max(0.0, self.private_tokens - tail)
        self.sequences -= 1


def _split(request: RouteRequest) -> tuple[float, float]:
    """(tokens per hashed segment, tokens outside any segment) of a prompt."""
    if not request.block_hashes:
        return 0.0, float(request.input_tokens)
    return request.input_tokens / len(request.block_hashes), 0.0


class DynamoKvPolicy:
    """Dynamo's KV router cost, greedy (softmax temperature 0).

    Parameters
    ----------
    overlap_score_weight
        Weight of the prefill blocks against the decode blocks (Dynamo's default 1).
    block_size
        KV block size in tokens (the engine's; vLLM's default 16). Both terms are in blocks.
    max_local_prefill_tokens
        P/D only: prefill on the decode worker when the uncached prompt is at most this long (Dynamo's older
        conditional disaggregation); None always disaggregates.
    seed
        Seeds the tie-break among equal costs.

    >>> from leadtime.features.rows import EndpointState
    >>> a, b = Candidate(EndpointState(endpoint_id="a"), 0), Candidate(EndpointState(endpoint_id="b"), 1600)
    >>> policy = DynamoKvPolicy()
    >>> policy.costs(RouteRequest("r", 3200), [a, b])  # 200 + 200 blocks on a; 100 + 200 on b
    [400.0, 300.0]
    >>> policy.pick(RouteRequest("r", 3200), [a, b]).endpoint_id
    'b'
    """

    name = "dynamo_kv"

    def __init__(
        self,
        overlap_score_weight: float = 1.0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_local_prefill_tokens: int | None = None,
        seed: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.overlap_score_weight = overlap_score_weight
        self.block_size = block_size
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self._rng = random.Random(seed)
        self._active: dict[str, ActiveBlocks] = {}
        self._routed: dict[str, tuple[RouteRequest, tuple[str, ...]]] = {}

    def active_blocks(self, endpoint_id: str) -> float:
        """Blocks of the sequences active on the worker (as this router tracks them)."""
        active = self._active.get(endpoint_id)
        return 0.0 if active is None else active.tokens / self.block_size

    def costs(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """Dynamo's cost per candidate worker (lower is better)."""
        out = []
        for c in candidates:
            hits = min(c.prefix_hit_tokens, request.input_tokens)
            prefill_blocks = (request.input_tokens - hits) / self.block_size
            active = self._active.get(c.endpoint_id)
            new = active.new_tokens(request) if active is not None else float(request.input_tokens)
            decode_blocks = self.active_blocks(c.endpoint_id) + new / self.block_size
            out.append(self.overlap_score_weight * prefill_blocks + decode_blocks)
        return out

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        ready = list(candidates)
        if not ready:
            raise NoCandidateError("no candidate endpoints")
        costs = self.costs(request, ready)
        low = min(costs)
        tied = [c for c, cost in zip(ready, costs, strict=True) if cost <= low + 1e-9 * max(1.0, abs(low))]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if not roles.disaggregated:
            chosen = self._choose(request, roles.unified)
            self._track(request, (chosen.endpoint_id,))
            return Pick(chosen.endpoint_id)
        decode = self._choose(request, roles.decode)
        limit = self.max_local_prefill_tokens
        if limit is not None and request.input_tokens - min(decode.prefix_hit_tokens, request.input_tokens) <= limit:
            self._track(request, (decode.endpoint_id,))
            return Pick(decode.endpoint_id)
        prefill = self._choose(request, roles.prefill)
        self._track(request, (prefill.endpoint_id, decode.endpoint_id))
        return Pick(prefill.endpoint_id, decode.endpoint_id)

    def _track(self, request: RouteRequest, endpoints: tuple[str, ...]) -> None:
        """The request's sequences are active on `endpoints` until it ends. One routed again under its id (a retry)
        moves: its earlier sequences, which its outcome would not free, go first."""
        self.abandon(request.request_id)
        for eid in endpoints:
            self._active.setdefault(eid, ActiveBlocks()).add(request)
        self._routed[request.request_id] = (request, endpoints)

    def prefilled(self, request_id: str, now_ms: float) -> None:
        """The first token came back: on P/D the prefill worker is done with the request, and Dynamo's prefill
        router frees its sequence there (the decode worker holds it until the request completes). A unified
        worker decodes what it prefilled: nothing changes."""
        routed = self._routed.get(request_id)
        if routed is None or len(routed[1]) < 2:
            return
        request, (prefill, *decode) = routed
        self._release(request, (prefill,))
        self._routed[request_id] = (request, tuple(decode))

    def observe(self, outcome: Outcome) -> None:
        """A request completed: its sequences are no longer active where it was sent."""
        self.abandon(outcome.request_id)

    def abandon(self, request_id: str) -> None:
        """The request failed: Dynamo frees its sequences as for a completed one, or they would count for ever."""
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            self._release(*routed)

    def _release(self, request: RouteRequest, endpoints: tuple[str, ...]) -> None:
        for eid in endpoints:
            active = self._active.get(eid)
            if active is not None:
                active.remove(request)
                if active.sequences <= 0:
                    del self._active[eid]
