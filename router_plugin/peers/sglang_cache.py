"""SGLang's cache-aware router, re-implemented from its documentation.

Source: SGLang's router documentation (sgl-router / SGLang Model Gateway), "Cache-Aware Load-Balancing
Router", and its options `--cache-threshold` (0.3), `--balance-abs-threshold` (64), `--balance-rel-threshold`
(1.5), `--max-tree-size`. The router never sees the workers' caches. It keeps, per worker, an approximate
radix tree of the prompts it has sent there (bounded, least recently used entries evicted first) and counts
the requests it has in flight on each worker (its load). For each request:

1. The load is imbalanced when max − min > balance_abs_threshold *and* max > balance_rel_threshold × min; then
   the request goes to the least loaded worker.
2. Otherwise (balanced) it finds the worker whose tree holds the longest prefix of the prompt. If that match
   covers more than `cache_threshold` of the prompt, the request goes there; if not, it goes to the worker
   with the smallest tree (the most cache room).
3. The prompt is inserted in the chosen worker's tree.

The trees here hold the request's chained block hashes (`RouteRequest.block_hashes`; equal leading hashes are
equal prefixes, as equal leading characters are in SGLang's character tree), so a prefix match is the run of
leading hashes a worker's tree has. SGLang's match rate is matched characters ÷ the prompt's characters; here it
is in tokens, min(matched segments × `segment_tokens`, prompt) ÷ prompt, as each hash names a fixed-size segment
but the last, which holds what is left (counting segments, a short tail weighed as much as a whole segment).
Tree size is counted in tokens. A prompt without hashes (a trace without prefix information) matches nothing and
is inserted as its own entry.

P/D (SGLang's PD router, `--pd-disaggregation`): the router places each request on a prefill worker and a
decode worker, each chosen by its policy over its own pool (`--prefill-policy`, `--decode-policy`, both
cache-aware here) with its own trees and loads; the decode worker pulls the KV from the prefill worker. Load is
counted on both workers until the response ends (the PD router holds one load guard over the pair for the whole
request), or fails (`abandon`: the guard drops with an error response too).

Time-slicing: it reads no time-slice orchestrator (a sleeping vLLM engine still answers its health check and
/metrics), so it may route to an endpoint whose accelerators another job holds; the requests wait there.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from leadtime.router_plugin.policy import Candidate, NoCandidateError, Outcome, Pick, RouteRequest, split_by_role

# SGLang bounds its tree at 2**26 characters per worker; at about 4 characters a token that is 2**24 tokens.
DEFAULT_MAX_TREE_TOKENS = 2**24
# What each of `RouteRequest.block_hashes` names: the Mooncake trace's hash_ids name 512-token blocks, and the
# simulator's workloads are cut so (`simulator.workload.MOONCAKE_SEGMENT_TOKENS`).
DEFAULT_SEGMENT_TOKENS = 512


class ApproximateTree:
    """The prompts one worker was sent: chained block hashes in LRU order, each with its tokens.

    >>> tree = ApproximateTree(max_tokens=1000)
    >>> tree.insert(RouteRequest("a", 600, (1, 2, 3)))
    >>> tree.matched((1, 2, 9)), tree.tokens
    (2, 600.0)
    >>> tree.insert(RouteRequest("b", 800, (5, 6)))  # 1400 tokens > 1000: the least recently used go first,
    >>> tree.matched((1, 2, 3)), tree.matched((5, 6)), tree.tokens  # leaves before the prefix they extend
    (1, 2, 1000.0)
    """

    def __init__(self, max_tokens: float = DEFAULT_MAX_TREE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0.0
        self._entries: OrderedDict[Hashable, float] = OrderedDict()

    def matched(self, hashes: Sequence[int]) -> int:
        """Leading hashes of the prompt held in the tree."""
        n = 0
        for h in hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def insert(self, request: RouteRequest) -> None:
        """Add the prompt (touching its head last, so that the head is the most recently used part)."""
        if request.block_hashes:
            per_segment = request.input_tokens / len(request.block_hashes)
            keys: list[Hashable] = list(reversed(request.block_hashes))
        else:
            per_segment = float(request.input_tokens)
            keys = [("prompt", request.request_id)]
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)
            else:
                self._entries[key] = per_segment
                self.tokens += per_segment
        while self.tokens > self.max_tokens and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= evicted


class SglangCachePolicy:
    """SGLang's cache-aware routing (balance check, then longest prefix match or smallest tree).

    Parameters
    ----------
    cache_threshold
        Share of the prompt the best match must exceed to route by cache (SGLang's default 0.3).
    balance_abs_threshold, balance_rel_threshold
        Load is imbalanced when max − min exceeds the first and max exceeds the second × min (64, 1.5).
    max_tree_tokens
        Bound of each worker's tree, in tokens.
    segment_tokens
        Tokens each block hash names (the last of a prompt's may hold fewer): what a matched hash counts for in the
        match rate.
    seed
        Seeds the tie-breaks.

    >>> from leadtime.features.rows import EndpointState
    >>> a, b = Candidate(EndpointState(endpoint_id="a")), Candidate(EndpointState(endpoint_id="b"))
    >>> policy = SglangCachePolicy()
    >>> first = policy.pick(RouteRequest("1", 1024, (7, 8)), [a, b]).endpoint_id
    >>> policy.pick(RouteRequest("2", 1536, (7, 8, 9)), [a, b]).endpoint_id == first  # 2 of 3 segments match
    True
    """

    name = "sglang_cache"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: float = DEFAULT_MAX_TREE_TOKENS,
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
        seed: int = 0,
    ) -> None:
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be ≥ 1, got {segment_tokens}")
        self.segment_tokens = segment_tokens
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self._rng = random.Random(seed)
        self._trees: dict[str, ApproximateTree] = {}
        self._load: dict[str, int] = {}
        self._routed: dict[str, tuple[str, ...]] = {}

    def load(self, endpoint_id: str) -> int:
        """Requests this router has in flight on the worker."""
        return self._load.get(endpoint_id, 0)

    def tree(self, endpoint_id: str) -> ApproximateTree:
        tree = self._trees.get(endpoint_id)
        if tree is None:
            tree = self._trees[endpoint_id] = ApproximateTree(self.max_tree_tokens)
        return tree

    def balanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [self.load(c.endpoint_id) for c in candidates]
        high, low = max(loads), min(loads)
        imbalanced = high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low
        return not imbalanced

    def _lowest(self, candidates: Sequence[Candidate], values: Sequence[float]) -> Candidate:
        low = min(values)
        tied = [c for c, v in zip(candidates, values, strict=True) if v == low]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def match_rate(self, request: RouteRequest, matched: int) -> float:
        """Share of the prompt's tokens that `matched` leading hashes cover (SGLang's, in characters).

        >>> SglangCachePolicy().match_rate(RouteRequest("r", 1560, (1, 2, 3, 4)), 1)  # 512 of 1,560
        0.3282051282051282
        """
        if request.input_tokens <= 0:
            return 0.0
        return min(matched * self.segment_tokens, request.input_tokens) / request.input_tokens

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        ready = list(candidates)
        if not ready:
            raise NoCandidateError("no candidate endpoints")
        if not self.balanced(ready):
            chosen = self._lowest(ready, [self.load(c.endpoint_id) for c in ready])
        else:
            hashes = request.block_hashes
            matches = [self.tree(c.endpoint_id).matched(hashes) for c in ready] if hashes else [0] * len(ready)
            best = max(matches)
            if hashes and self.match_rate(request, best) > self.cache_threshold:
                chosen = self._lowest(ready, [-m for m in matches])
            else:
                chosen = self._lowest(ready, [self.tree(c.endpoint_id).tokens for c in ready])
        self.tree(chosen.endpoint_id).insert(request)
        return chosen

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if roles.disaggregated:
            prefill = self._choose(request, roles.prefill)
            decode = self._choose(request, roles.decode)
            self._track(request.request_id, (prefill.endpoint_id, decode.endpoint_id))
            return Pick(prefill.endpoint_id, decode.endpoint_id)
        chosen = self._choose(request, roles.unified)
        self._track(request.request_id, (chosen.endpoint_id,))
        return Pick(chosen.endpoint_id)

    def _track(self, request_id: str, endpoints: tuple[str, ...]) -> None:
        """Count the request on `endpoints` until it ends. One routed again under its id (a retry) moves: what its
        earlier pick counted, which its outcome would not let go of, goes first."""
        self.abandon(request_id)
        for eid in endpoints:
            self._load[eid] = self._load.get(eid, 0) + 1
        self._routed[request_id] = endpoints

    def observe(self, outcome: Outcome) -> None:
        """A request completed: it no longer counts in its workers' loads."""
        self.abandon(outcome.request_id)

    def abandon(self, request_id: str) -> None:
        """The request failed: its load guard drops as for a completed one, or it would count for ever."""
        for eid in self._routed.pop(request_id, ()):
            self._load[eid] = max(0, self._load.get(eid, 0) - 1)

    def forget_endpoint(self, endpoint_id: str) -> None:
        """The worker left: its tree goes (SGLang's router drops a removed worker's), so a worker that comes back
        under its name, its cache empty, is not credited with the prompts sent before. Its load drains as the
        requests still in flight there end."""
        self._trees.pop(endpoint_id, None)
