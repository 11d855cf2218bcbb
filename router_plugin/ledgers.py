"""A router's two ledgers of what it has in flight, the share of its decisions that found no endpoint in time, and
the events that keep several router replicas' ledgers together.

The in-flight ledger (`router_plugin.inflight`) and the decoding ledger (`router_plugin.decoding`) hold what one
router has sent and not seen complete. Behind a load balancer, several replicas each route a share of the requests;
each would see only its own sends, and a burst split between them would again land on the endpoint that looked
idle. In the simulator (`bench routing`'s `leadtime_x4`: four replicas each routing every fourth request beside one
shared predictor, seeds 0–2) that cost up to 7% goodput and up to three times the TTFT tail; replicas that tell each
other every change of their ledgers and every decision's judgement (`leadtime_x4_shared`) route as one router does,
within 2.4% of its goodput in every cell.

So every change is an event: recorded here, applied to the ledgers, and handed to `outbox` (a replica publishes it
to the others); `apply` takes the events of the other replicas. Times in events are the sender's clock: whoever
carries them between processes converts them (`Sent.shifted`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from leadtime.router_plugin.decoding import DecodingLedger
from leadtime.router_plugin.inflight import InflightLedger, Sent

T = TypeVar("T")

EVENT_KINDS = ("prefill", "decode", "decoding", "complete", "judged")
"""prefill: a request will be prefilled on an endpoint; decode: it will decode on a P/D decode endpoint once its KV
arrives; decoding: it decodes on an endpoint with an ITL SLO (the decode-harm weighing); complete: it no longer
counts anywhere; judged: a decision found a candidate predicted to serve its request in time, or none (`in_time`),
which moves the share of recent decisions that found none (the fleet is overloaded when it is high)."""


@dataclass(frozen=True)
class LedgerEvent:
    """One change of a router's ledgers.

    >>> e = LedgerEvent("prefill", "r1", "e1", Sent("r1", 100.0, 800, 1000))
    >>> LedgerEvent.from_dict(e.to_dict()) == e
    True
    >>> LedgerEvent.from_dict({"kind": "evict", "request_id": "r1"})
    Traceback (most recent call last):
    ...
    ValueError: kind: 'evict' is not one of prefill, decode, decoding, complete, judged
    """

    kind: str
    request_id: str
    endpoint_id: str = ""
    sent: Sent | None = None
    itl_slo_ms: float = 0.0
    in_time: bool = True

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "request_id": self.request_id}
        if self.endpoint_id:
            d["endpoint_id"] = self.endpoint_id
        if self.sent is not None:
            d["sent"] = dataclasses.asdict(self.sent)
        if self.itl_slo_ms:
            d["itl_slo_ms"] = self.itl_slo_ms
        if self.kind == "judged":
            d["in_time"] = self.in_time
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LedgerEvent:
        """An event as another replica sent it; ValueError naming the field when it is not one."""
        kind = d.get("kind")
        if kind not in EVENT_KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {', '.join(EVENT_KINDS)}")
        request_id = required_text(d, "request_id")
        endpoint_id = required_text(d, "endpoint_id") if kind not in ("complete", "judged") else ""
        sent = None
        if kind in ("prefill", "decode"):
            sent = dataclass_of_numbers(Sent, d.get("sent"), "sent")
            if sent.request_id != request_id:
                raise ValueError("sent.request_id: not the event's request")
        itl_slo_ms = d.get("itl_slo_ms", 0.0)
        if kind == "decoding" and not (_finite(itl_slo_ms) and itl_slo_ms > 0):
            raise ValueError("itl_slo_ms: expected a number > 0")
        in_time = d.get("in_time", True)
        if not isinstance(in_time, bool):
            raise ValueError("in_time: expected true or false")
        return cls(kind, request_id, endpoint_id, sent, float(itl_slo_ms), in_time)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def required_text(raw: Mapping[str, Any], name: str) -> str:
    """`raw[name]`, a non-empty string, or ValueError naming it."""
    value = raw.get(name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: expected a non-empty string")
    return value


def dataclass_of_numbers(cls: type[T], raw: object, name: str) -> T:
    """`cls(**raw)` for a dataclass of ids, flags and numbers as another replica sent it: every number finite, or
    ValueError naming the field.

    >>> dataclass_of_numbers(Sent, {"request_id": "r", "sent_ms": float("nan"), "uncached_tokens": 1,
    ...                             "input_tokens": 1}, "sent")
    Traceback (most recent call last):
    ...
    ValueError: sent.sent_ms: expected a finite number
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{name}: expected an object")
    try:
        value = cls(**raw)
    except TypeError as err:
        raise ValueError(f"{name}: {err}") from None
    for f in dataclasses.fields(value):  # type: ignore[arg-type]
        v, kind = getattr(value, f.name), str(f.type)  # annotations are strings here (postponed evaluation)
        if kind == "str" and not isinstance(v, str):
            raise ValueError(f"{name}.{f.name}: expected a string")
        if kind == "bool" and not isinstance(v, bool):
            raise ValueError(f"{name}.{f.name}: expected true or false")
        if kind not in ("str", "bool") and not _finite(v):
            raise ValueError(f"{name}.{f.name}: expected a finite number")
    return value


class RouterLedgers:
    """The in-flight and decoding ledgers of one router, and the share of its recent decisions that found no
    candidate in time (`overload`, a moving average over `overload_window` decisions); every change recorded here is
    also handed to `outbox`.

    >>> told = []
    >>> mine, theirs = RouterLedgers(), RouterLedgers()
    >>> mine.outbox = told.append
    >>> mine.record_prefill("e1", Sent("r1", 100.0, 800, 1000))
    >>> for event in told:
    ...     theirs.apply(event)
    >>> len(theirs.inflight), theirs.inflight.pending("e1")[0].uncached_tokens
    (1, 800)
    >>> mine.complete("r1"); theirs.apply(told[-1])
    >>> len(mine.inflight), len(theirs.inflight)
    (0, 0)
    """

    def __init__(self, overload_window: int = 200) -> None:
        self.inflight = InflightLedger()
        self.decoding = DecodingLedger()
        self.overload = 0.0
        self.overload_window = overload_window
        self.outbox: Callable[[LedgerEvent], None] | None = None

    def record_prefill(self, endpoint_id: str, sent: Sent) -> None:
        self._record(LedgerEvent("prefill", sent.request_id, endpoint_id, sent))

    def record_decode(self, endpoint_id: str, sent: Sent) -> None:
        self._record(LedgerEvent("decode", sent.request_id, endpoint_id, sent))

    def record_decoding(self, endpoint_id: str, request_id: str, itl_slo_ms: float) -> None:
        self._record(LedgerEvent("decoding", request_id, endpoint_id, itl_slo_ms=itl_slo_ms))

    def complete(self, request_id: str) -> None:
        self._record(LedgerEvent("complete", request_id))

    def record_judgement(self, request_id: str, in_time: bool) -> None:
        self._record(LedgerEvent("judged", request_id, in_time=in_time))

    def _record(self, event: LedgerEvent) -> None:
        self.apply(event)
        if self.outbox is not None:
            self.outbox(event)

    def apply(self, event: LedgerEvent) -> None:
        """Apply a change (one of this router's, or one another replica told it of)."""
        if event.kind == "prefill" and event.sent is not None:
            self.inflight.record_prefill(event.endpoint_id, event.sent)
        elif event.kind == "decode" and event.sent is not None:
            self.inflight.record_decode(event.endpoint_id, event.sent)
        elif event.kind == "decoding":
            self.decoding.record(event.endpoint_id, event.request_id, event.itl_slo_ms)
        elif event.kind == "complete":
            self.inflight.complete(event.request_id)
            self.decoding.complete(event.request_id)
        elif event.kind == "judged":
            self.overload += (float(not event.in_time) - self.overload) / self.overload_window
