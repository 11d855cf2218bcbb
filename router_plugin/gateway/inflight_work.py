"""The work this gateway has in flight on each endpoint, in tokens: what vLLM's /metrics does not say.

A scrape gives requests running and waiting and the KV cache's fill, not how much prompt is still to prefill or
how much KV the decoding requests hold, and with prompts of 12,000 tokens beside prompts of 200 the counts alone
say little. llm-d's router fills `prefill_tokens_in_flight` and `decode_tokens_in_flight` from its own
accounting; so does the gateway, from what it proxies: a request counts its uncached prompt tokens as prefill
work on the endpoint that prefills it until its first token arrives, then its prompt and the tokens generated so
far as decode work on the endpoint that decodes it, until it completes.

Only requests sent before the endpoint's last scrape are counted here: the policy's in-flight ledger adds those
sent since (`router_plugin.inflight`), and counting them twice would make the endpoint look busier than it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leadtime.features.rows import EndpointState


@dataclass
class Active:
    """One proxied request as the work tracker sees it."""

    sent_ms: float
    uncached_tokens: int
    input_tokens: int
    prefill_on: str
    decode_on: str
    first_token: bool = False
    generated: int = 0


@dataclass
class InflightWork:
    """Per endpoint, the requests this gateway sent there that have not completed.

    >>> work = InflightWork()
    >>> work.start("r1", Active(sent_ms=10.0, uncached_tokens=900, input_tokens=1000, prefill_on="e", decode_on="e"))
    >>> work.tokens("e", published_ms=20.0)  # (prefill, decode): still prefilling
    (900, 0)
    >>> work.first_token("r1", generated=1)
    >>> work.tokens("e", published_ms=20.0), work.tokens("e", published_ms=5.0)  # decoding; sent after the scrape
    ((0, 1001), (0, 0))
    >>> work.finish("r1")
    >>> work.tokens("e", published_ms=20.0)
    (0, 0)
    """

    _requests: dict[str, Active] = field(default_factory=dict)
    _by_endpoint: dict[str, set[str]] = field(default_factory=dict)

    def start(self, request_id: str, active: Active) -> None:
        self._requests[request_id] = active
        for endpoint_id in {active.prefill_on, active.decode_on}:
            self._by_endpoint.setdefault(endpoint_id, set()).add(request_id)

    def first_token(self, request_id: str, generated: int) -> None:
        active = self._requests.get(request_id)
        if active is not None:
            active.first_token = True
            active.generated = generated

    def progress(self, request_id: str, generated: int) -> None:
        active = self._requests.get(request_id)
        if active is not None:
            active.generated = generated

    def finish(self, request_id: str) -> None:
        """The request completed or was abandoned. An endpoint left with none goes: in Kubernetes endpoint names
        are pod names, and every rollout would add empty sets for ever."""
        active = self._requests.pop(request_id, None)
        if active is None:
            return
        for endpoint_id in {active.prefill_on, active.decode_on}:
            ids = self._by_endpoint.get(endpoint_id)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self._by_endpoint[endpoint_id]

    def tokens(self, endpoint_id: str, published_ms: float) -> tuple[int, int]:
        """(prefill tokens, decode tokens) in flight on the endpoint, of requests sent before `published_ms`."""
        prefill = decode = 0
        for request_id in self._by_endpoint.get(endpoint_id, ()):
            a = self._requests[request_id]
            if a.sent_ms >= published_ms:
                continue
            if not a.first_token:
                if a.prefill_on == endpoint_id:
                    prefill += a.uncached_tokens
            elif a.decode_on == endpoint_id:
                decode += a.input_tokens + a.generated
        return prefill, decode

    def __len__(self) -> int:
        return len(self._requests)


def with_tokens(state: EndpointState, prefill: int, decode: int) -> EndpointState:
    """`state` with the tracker's token counts (counts it computed itself: not validated again)."""
    if state.prefill_tokens_in_flight == prefill and state.decode_tokens_in_flight == decode:
        return state
    new = object.__new__(EndpointState)
    new.__dict__.update(state.__dict__)
    new.__dict__["prefill_tokens_in_flight"] = prefill
    new.__dict__["decode_tokens_in_flight"] = decode
    return new
