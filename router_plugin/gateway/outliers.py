"""Endpoints that fail their requests, taken out of routing for a while (outlier ejection, as Envoy does it).

An endpoint's scraped state says how loaded it is, not whether it serves: a pod that answers every completion
with a 500 in a millisecond, or breaks its streams, while its `/metrics` says "0 running", looks like the
emptiest endpoint of the fleet, and a latency router then sends it nearly everything (96 % of a test's traffic).
So the gateway counts what each endpoint does with the requests it is sent:

- `consecutive` failures in a row (an answer of 5xx, a connection that breaks before or during the answer, a
  stream that carries no answer) take it out for `base_s`, twice that the next time, up to `max_s`;
- a connection refused takes it out at once, until a scrape of it succeeds again (the port is closed: nothing
  sent there can be served; a restarted pod is back within a scrape);
- back in, it is on probation: one more failure takes it out again (for the longer time), a success clears its
  record. A request counts as a success when its answer, below 500, has been read to its end (a 4xx is the
  client's); a failure of a request sent before the endpoint came back does not count against it again.
- more than half of the endpoints out at once is no longer an endpoint's fault (a request type every pod fails, a
  shared dependency): the gateway then routes to all of them, as Envoy does under its panic threshold, rather
  than answer every request 503 for up to 300 s (`app.Gateway.routable`, `PANIC_SHARE`).

Each change is logged once, counted (`endpoint_ejections_total`), shown by `endpoint_routable` and named under
`/readyz`'s `degraded`. Ejections alone never leave a request without an endpoint: with every endpoint out, all
of them are routed to (the panic threshold above), and clients get what the endpoints answer, not a 503 of the
gateway's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger("leadtime.router.outliers")

CONSECUTIVE_FAILURES = 5
"""Failures in a row that take an endpoint out (Envoy's `consecutive_5xx` default)."""
BASE_EJECTION_S = 30.0
"""How long a first ejection lasts (Envoy's `base_ejection_time` default); each next one twice the last."""
MAX_EJECTION_S = 300.0
"""The longest an ejection lasts (Envoy's `max_ejection_time` default)."""


@dataclass
class _Record:
    consecutive: int = 0
    ejections: int = 0
    until_ms: float | None = None
    """Out until then (router clock)."""
    refused_at_ms: float | None = None
    """Out since a connection was refused then, until a scrape asked after it succeeds."""
    probation: bool = False
    back_ms: float = -1.0
    """When it last came back in: failures of requests sent before then are not its probation's."""
    why: str = ""


class Outliers:
    """Which endpoints are out of routing for failing their requests.

    Parameters
    ----------
    clock
        Milliseconds on the router's clock.
    on_ejection
        Called with the endpoint's id each time it is taken out (the gateway counts them).

    >>> now = [0.0]
    >>> outliers = Outliers(lambda: now[0])
    >>> for _ in range(CONSECUTIVE_FAILURES):
    ...     outliers.failed("e1", "answered 500")
    >>> outliers.out("e1"), outliers.out("e2")
    (True, False)
    >>> now[0] = BASE_EJECTION_S * 1e3
    >>> outliers.out("e1")  # back, on probation
    False
    >>> outliers.failed("e1", "answered 500"); outliers.out("e1")  # one failure is enough now
    True
    """

    def __init__(
        self,
        clock: Callable[[], float],
        consecutive: int = CONSECUTIVE_FAILURES,
        base_s: float = BASE_EJECTION_S,
        max_s: float = MAX_EJECTION_S,
        on_ejection: Callable[[str], None] | None = None,
    ) -> None:
        self.clock = clock
        self.consecutive = consecutive
        self.base_s = base_s
        self.max_s = max_s
        self.on_ejection = on_ejection
        self._records: dict[str, _Record] = {}

    def failed(self, endpoint_id: str, why: str, refused: bool = False, sent_ms: float | None = None) -> None:
        """A request sent to the endpoint (at `sent_ms`, when known) failed (`refused`: its connection was
        refused)."""
        record = self._records.setdefault(endpoint_id, _Record())
        now = self.clock()
        if refused:
            if record.refused_at_ms is None:
                record.refused_at_ms = now
                record.why = why
                log.warning("%s taken out of routing: %s (back when a scrape of it succeeds)", endpoint_id, why)
                self._ejected(endpoint_id)
            return
        if self.out(endpoint_id) or (sent_ms is not None and sent_ms < record.back_ms):
            return  # requests sent before it was taken out, or before it came back, failing now
        record.consecutive += 1
        if record.consecutive < self.consecutive and not record.probation:
            return
        record.ejections += 1
        seconds = min(self.base_s * 2.0 ** (record.ejections - 1), self.max_s)
        record.until_ms = now + seconds * 1e3
        in_a_row = "on probation" if record.probation else f"{record.consecutive} failures in a row"
        record.why = f"{why} ({in_a_row})"
        record.consecutive, record.probation = 0, False
        log.warning("%s taken out of routing for %g s: %s", endpoint_id, seconds, record.why)
        self._ejected(endpoint_id)

    def answered(self, endpoint_id: str) -> None:
        """A request sent to the endpoint was answered, below 500 and to the end of its answer: its record is
        cleared."""
        record = self._records.get(endpoint_id)
        if record is not None and record.until_ms is None and record.refused_at_ms is None:
            del self._records[endpoint_id]

    def scraped(self, endpoint_id: str, asked_ms: float) -> None:
        """A scrape of the endpoint asked at `asked_ms` succeeded: a refused connection before it is over."""
        record = self._records.get(endpoint_id)
        if record is not None and record.refused_at_ms is not None and asked_ms > record.refused_at_ms:
            record.refused_at_ms = None
            log.info("%s back in routing: it accepts connections again", endpoint_id)
            if record.until_ms is None:
                record.probation, record.back_ms = True, self.clock()

    def out(self, endpoint_id: str) -> bool:
        """Whether the endpoint is out of routing now."""
        record = self._records.get(endpoint_id)
        if record is None:
            return False
        if record.refused_at_ms is not None:
            return True
        if record.until_ms is None:
            return False
        if self.clock() < record.until_ms:
            return True
        record.until_ms = None
        record.probation, record.back_ms = True, self.clock()
        log.info("%s back in routing, on probation (one more failure takes it out again)", endpoint_id)
        return False

    def health(self) -> dict[str, str]:
        """The endpoints out now and why, for `/readyz`'s `degraded`."""
        now = self.clock()
        out = {}
        for endpoint_id, record in self._records.items():
            if not self.out(endpoint_id):
                continue
            if record.refused_at_ms is not None:
                out[endpoint_id] = f"out of routing: {record.why}; back when a scrape of it succeeds"
            elif record.until_ms is not None:
                out[endpoint_id] = f"out of routing: {record.why}; back in {(record.until_ms - now) / 1e3:.0f} s"
        return out

    def keep_only(self, endpoint_ids: Iterable[str]) -> None:
        """Forget endpoints discovery no longer lists (one coming back under the name starts afresh)."""
        wanted = set(endpoint_ids)
        for endpoint_id in list(self._records):
            if endpoint_id not in wanted:
                del self._records[endpoint_id]

    def _ejected(self, endpoint_id: str) -> None:
        if self.on_ejection is not None:
            self.on_ejection(endpoint_id)
