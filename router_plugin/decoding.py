"""What a prefill costs the requests already decoding where it lands.

vLLM schedules a prompt's prefill chunks in the same steps as the decodes of every request running on that
endpoint, so each of them waits out the prefill's compute over the steps it decodes in. A request is spoiled not
only by the batch it joins but by the prompts routed to its endpoint after it: on the homogeneous fleet at 85% load
(seed 0), the requests that missed the 50 ms ITL SLO had 1.5x the uncached prompt tokens per second landing on
their endpoint while they decoded, and short outputs (median 145 tokens against 366), which a chunk stalls for a
larger share of their steps. Scoring a candidate by the request at hand alone cannot see that.

So the router remembers, per endpoint, the ITL SLO of every request it sent there that has not completed, and
estimates what a new prompt would take from them: its prefill time at the roofline, spread over the steps of an
output of the mean length, is that much more ITL for each, and a share `1 / ITL SLO` of each one's headroom.

    harm = own_prefill_ms / mean_output_tokens · Σ_j 1 / itl_slo_j       (over the requests in flight there)

`scorers.latency.shared_step_scores` weighs a candidate's score by it. Every request the router has sent and not
seen complete counts, queued or decoding: a queued request decodes beside the prompts that arrive after it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Endpoint:
    slo_ms: dict[str, float] = field(default_factory=dict)  # request id → its ITL SLO
    inverse_sum: float = 0.0  # Σ 1 / ITL SLO over them


@dataclass
class DecodingLedger:
    """Per endpoint, the ITL SLOs of the requests this router sent there that have not completed.

    >>> ledger = DecodingLedger()
    >>> ledger.record("e1", "r1", 50.0)
    >>> ledger.record("e1", "r2", 100.0)
    >>> ledger.inverse_slo_sums(["e1", "e2"]).tolist()
    [0.03, 0.0]
    >>> ledger.complete("r1")
    >>> ledger.inverse_slo_sums(["e1"]).round(9).tolist()
    [0.01]
    """

    _endpoints: dict[str, _Endpoint] = field(default_factory=dict)
    _where: dict[str, str] = field(default_factory=dict)

    def record(self, endpoint_id: str, request_id: str, itl_slo_ms: float) -> None:
        """`request_id`, with an ITL SLO of `itl_slo_ms` (> 0), decodes on `endpoint_id` until it completes."""
        if itl_slo_ms <= 0:
            raise ValueError(f"itl_slo_ms must be > 0, got {itl_slo_ms}")
        self.complete(request_id)  # a request decodes in one place: a retry moves it
        slot = self._endpoints.setdefault(endpoint_id, _Endpoint())
        slot.slo_ms[request_id] = itl_slo_ms
        slot.inverse_sum += 1.0 / itl_slo_ms
        self._where[request_id] = endpoint_id

    def complete(self, request_id: str) -> None:
        """The request completed or was abandoned: it no longer decodes anywhere (unknown ids are ignored)."""
        endpoint_id = self._where.pop(request_id, None)
        if endpoint_id is None:
            return
        slot = self._endpoints[endpoint_id]
        slot.inverse_sum -= 1.0 / slot.slo_ms.pop(request_id)
        if not slot.slo_ms:  # and the sum's rounding with it
            del self._endpoints[endpoint_id]

    def inverse_slo_sums(self, endpoint_ids: list[str]) -> np.ndarray:
        """Σ 1 / ITL SLO (per ms) over each endpoint's requests in flight, in the order given."""
        empty = _Endpoint()
        return np.array([self._endpoints.get(e, empty).inverse_sum for e in endpoint_ids], dtype=np.float64)

    def __len__(self) -> int:
        return len(self._where)


def decode_harm(own_prefill_ms: np.ndarray, mean_output_tokens: float, inverse_slo_sums: np.ndarray) -> np.ndarray:
    """The ITL headroom a prefill of `own_prefill_ms` on each candidate takes from the requests in flight there,
    summed over them (see the module docstring).

    A 2 s prefill, outputs of 200 tokens on average: 10 ms more ITL for each request decoding beside it, a fifth of
    a 50 ms SLO's headroom and a tenth of a 100 ms one's.

    >>> decode_harm(np.array([2000.0, 2000.0]), 200.0, np.array([1 / 50 + 1 / 100, 0.0])).round(6).tolist()
    [0.3, 0.0]
    """
    return np.asarray(own_prefill_ms, dtype=np.float64) / max(mean_output_tokens, 1.0) * inverse_slo_sums
