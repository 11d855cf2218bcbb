"""What the router itself has sent each endpoint since that endpoint last published its state.

An endpoint's published state (scraped /metrics, or the simulator's publication every `refresh_ms`) lags the
router: a burst of simultaneous arrivals would all see the one endpoint that looked idle a moment ago and all
land there. The ledger remembers every routed request until it completes and adds, to each candidate's state,
the requests the state cannot contain yet:

- on an endpoint that prefills (unified or prefill role), those sent at or after the state's publication time:
  each is one more waiting request and its uncached prompt tokens more prefill work queued;
- on a decode endpoint of a P/D pair, those whose KV was expected to arrive after the publication time: each is
  one more running request holding its prompt's KV (decode tokens in flight);
- on a decode endpoint's KV link, the transfers expected to be on it: those whose prefill is expected done
  by now, queued in that order (first done, first sent), and a new transfer queues behind them. Transfers whose
  prefill is still ahead do not block it: the link sends in the order prefills finish, and a request sent to a
  deep prefill queue would otherwise hold every later request's link for as long as that queue.

Only the router's own sends are counted; completions the state does not show yet are not subtracted, so the
estimate errs towards a busier endpoint, which is the safe side for a burst.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from leadtime.features.rows import MAX_COUNT, EndpointState


@dataclass
class Sent:
    """One routed request, as the ledger remembers it."""

    request_id: str
    sent_ms: float
    uncached_tokens: int
    input_tokens: int
    kv_arrival_ms: float = 0.0  # P/D decode side: when its KV was expected to land
    ready_ms: float = 0.0  # P/D decode side: when its prefill was expected done (its transfer can start)
    transfer_ms: float = 0.0  # P/D decode side: how long its KV transfer takes on the link

    def shifted(self, offset_ms: float) -> Sent:
        """The same send on a clock `offset_ms` ahead: its times move, the transfer's duration does not.

        >>> s = Sent("r", 100.0, 0, 10, kv_arrival_ms=300.0, ready_ms=200.0, transfer_ms=50.0).shifted(1000.0)
        >>> s.sent_ms, s.kv_arrival_ms, s.ready_ms, s.transfer_ms
        (1100.0, 1300.0, 1200.0, 50.0)
        """
        return dataclasses.replace(
            self,
            sent_ms=self.sent_ms + offset_ms,
            kv_arrival_ms=self.kv_arrival_ms + offset_ms,
            ready_ms=self.ready_ms + offset_ms,
        )


@dataclass
class _Endpoint:
    # Prefill sends in the order they were recorded, each with the latest `sent_ms` recorded up to it: reading
    # them newest first, `adjusted` stops where that is older than the publication (nothing before counts).
    prefill: dict[str, tuple[Sent, float]] = field(default_factory=dict)
    decode: dict[str, Sent] = field(default_factory=dict)
    latest_sent_ms: float = -math.inf


class InflightLedger:
    """Per endpoint, the requests routed there that have not completed.

    >>> ledger = InflightLedger()
    >>> ledger.record_prefill("e1", Sent("r1", sent_ms=100.0, uncached_tokens=800, input_tokens=1000))
    >>> state = EndpointState(endpoint_id="e1", num_request_waiting=2, prefill_tokens_in_flight=500)
    >>> later = ledger.adjusted(state, published_ms=50.0)  # published before r1 was sent: r1 is not in it
    >>> later.num_request_waiting, later.prefill_tokens_in_flight
    (3, 1300)
    >>> ledger.adjusted(state, published_ms=150.0) is state  # published after: already counted
    True
    >>> ledger.complete("r1")
    >>> ledger.adjusted(state, published_ms=50.0) is state
    True
    """

    def __init__(self) -> None:
        self._endpoints: dict[str, _Endpoint] = {}
        self._where: dict[str, list[tuple[str, str]]] = {}

    def _slot(self, endpoint_id: str) -> _Endpoint:
        slot = self._endpoints.get(endpoint_id)
        if slot is None:
            slot = self._endpoints[endpoint_id] = _Endpoint()
        return slot

    def record_prefill(self, endpoint_id: str, sent: Sent) -> None:
        """`sent` will be prefilled on `endpoint_id` (a unified endpoint, a prefill endpoint, or a decode
        endpoint prefilling locally)."""
        slot = self._slot(endpoint_id)
        slot.latest_sent_ms = max(slot.latest_sent_ms, sent.sent_ms)
        slot.prefill.pop(sent.request_id, None)  # recorded again: it moves to the end of the order
        slot.prefill[sent.request_id] = (sent, slot.latest_sent_ms)
        self._where.setdefault(sent.request_id, []).append((endpoint_id, "prefill"))

    def record_decode(self, endpoint_id: str, sent: Sent) -> None:
        """`sent` will decode on `endpoint_id` once its KV (expected at `kv_arrival_ms`) has arrived."""
        self._slot(endpoint_id).decode[sent.request_id] = sent
        self._where.setdefault(sent.request_id, []).append((endpoint_id, "decode"))

    def complete(self, request_id: str) -> None:
        """The request finished: it no longer counts anywhere. A slot left empty goes, as in `DecodingLedger`: in
        Kubernetes endpoint names are pod names, and every rollout would add slots for ever. Nothing counted
        changes: `latest_sent_ms` only lets `adjusted` stop early, and a new slot's bounds the sends in it as well."""
        for endpoint_id, side in self._where.pop(request_id, ()):
            slot = self._endpoints.get(endpoint_id)
            if slot is None:  # recorded twice there (a retry), and emptied at the first
                continue
            (slot.prefill if side == "prefill" else slot.decode).pop(request_id, None)
            if not slot.prefill and not slot.decode:
                del self._endpoints[endpoint_id]

    def pending(self, endpoint_id: str) -> Iterable[Sent]:
        slot = self._endpoints.get(endpoint_id)
        return () if slot is None else [sent for sent, _ in slot.prefill.values()]

    def adjusted(self, state: EndpointState, published_ms: float) -> EndpointState:
        """`state` plus what was sent after it was published (the same object when nothing was)."""
        slot = self._endpoints.get(state.endpoint_id)
        if slot is None:
            return state
        waiting = prefill_tokens = running = decode_tokens = 0
        # Newest first, so that a deep queue costs only its sends since the publication, not all of them.
        for s, latest in reversed(slot.prefill.values()):
            if latest < published_ms:
                break  # this one and every one recorded before it were sent before the publication
            if s.sent_ms >= published_ms:
                waiting += 1
                prefill_tokens += s.uncached_tokens
        for s in slot.decode.values():
            if s.kv_arrival_ms > published_ms:
                running += 1
                decode_tokens += s.input_tokens
        if not (waiting or running):
            return state
        # Each count kept within MAX_COUNT, the most a state may hold: a state published at it, or two prompts of
        # MAX_COUNT tokens, made a state refused (FeatureError) at every decision offering the endpoint.
        return state.with_counts(
            num_request_waiting=min(state.num_request_waiting + waiting, MAX_COUNT),
            prefill_tokens_in_flight=min(state.prefill_tokens_in_flight + prefill_tokens, MAX_COUNT),
            num_request_running=min(state.num_request_running + running, MAX_COUNT),
            decode_tokens_in_flight=min(state.decode_tokens_in_flight + decode_tokens, MAX_COUNT),
        )

    def link_free_ms(self, endpoint_id: str, now_ms: float) -> float:
        """When the decode endpoint's KV link is expected to be free of the transfers ready by `now_ms`, sent
        one after the other in the order they became ready.

        >>> ledger = InflightLedger()
        >>> ledger.record_decode("d", Sent("a", 0.0, 0, 0, ready_ms=100.0, transfer_ms=50.0))
        >>> ledger.record_decode("d", Sent("b", 0.0, 0, 0, ready_ms=110.0, transfer_ms=50.0))
        >>> ledger.record_decode("d", Sent("far", 0.0, 0, 0, ready_ms=60_000.0, transfer_ms=50.0))
        >>> ledger.link_free_ms("d", 120.0), ledger.link_free_ms("d", 500.0)
        (200.0, 500.0)
        """
        slot = self._endpoints.get(endpoint_id)
        if slot is None:
            return now_ms
        free = -math.inf
        ready = sorted((s.ready_ms, s.transfer_ms) for s in slot.decode.values() if s.ready_ms <= now_ms)
        for start, duration in ready:
            free = max(free, start) + duration
        return max(free, now_ms)

    def __len__(self) -> int:
        return len(self._where)
