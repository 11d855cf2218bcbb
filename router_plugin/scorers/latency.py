"""The predicted-latency scorer: SLO headroom from predicted TTFT and ITL, a score in [0, 1] per candidate.

With SLOs, a candidate's headroom on one target is the share of its SLO left over by the prediction,
`h = 1 − predicted / SLO` (1: no latency at all, 0: exactly at the SLO, negative: a predicted miss), and its score
is set mostly by the binding target, with the other one breaking ties:

    H = 0.9 · min(h_ttft, h_itl) + 0.1 · max(h_ttft, h_itl)
    score = clip((1 + H) / 2, 0, 1), then at least 0.5 if both SLOs are predicted met, below 0.5 if either is not

so a candidate predicted to meet both SLOs scores at least 0.5, more the more slack it leaves, and one predicted
to miss scores below 0.5, less the worse the miss. The predictions used against SLOs are the upper quantile
(p90 by default): a miss costs a request its SLO while a little more slack costs nothing. With only one SLO, only
that target counts. Without SLOs the score is the lowest predicted latency over the candidates divided by this
one's (1 for the fastest), with the latency of a request taken as its mean TTFT plus its expected output tokens at
the mean ITL.
"""

from __future__ import annotations

import numpy as np

FEASIBLE = 0.5
"""Scores at or above this are predicted to meet every SLO the request has."""


def headroom(predicted_ms: np.ndarray, slo_ms: float) -> np.ndarray:
    """Share of the SLO left: 1 − predicted / SLO.

    >>> headroom(np.array([50.0, 100.0, 150.0]), 100.0).tolist()
    [0.5, 0.0, -0.5]
    """
    return 1.0 - np.asarray(predicted_ms, dtype=np.float64) / slo_ms


def slo_scores(
    ttft_ms: np.ndarray, itl_ms: np.ndarray, ttft_slo_ms: float | None, itl_slo_ms: float | None
) -> np.ndarray:
    """Scores against the SLOs the request has (at least one of them).

    >>> slo_scores(np.array([500.0, 1500.0, 3000.0]), np.array([20.0, 20.0, 20.0]), 2000.0, 100.0).round(4).tolist()
    [0.8775, 0.6525, 0.315]
    >>> slo_scores(np.array([500.0]), np.array([150.0]), 2000.0, 100.0).round(4).tolist()  # the ITL SLO binds
    [0.3125]
    """
    parts = []
    if ttft_slo_ms is not None:
        parts.append(headroom(ttft_ms, ttft_slo_ms))
    if itl_slo_ms is not None:
        parts.append(headroom(itl_ms, itl_slo_ms))
    if not parts:
        raise ValueError("slo_scores needs at least one SLO")
    if len(parts) == 1:
        return np.clip((1.0 + parts[0]) / 2.0, 0.0, 1.0)
    low, high = np.minimum(parts[0], parts[1]), np.maximum(parts[0], parts[1])
    score = np.clip((1.0 + 0.9 * low + 0.1 * high) / 2.0, 0.0, 1.0)
    return np.where(low >= 0.0, np.maximum(score, FEASIBLE), np.minimum(score, np.nextafter(FEASIBLE, 0.0)))


def latency_scores(ttft_ms: np.ndarray, itl_ms: np.ndarray, expected_output_tokens: float) -> np.ndarray:
    """Scores without SLOs: the fastest candidate scores 1, one twice as slow 0.5.

    >>> latency_scores(np.array([100.0, 200.0]), np.array([10.0, 10.0]), 0.0).tolist()
    [1.0, 0.5]
    """
    latency = np.maximum(np.asarray(ttft_ms) + expected_output_tokens * np.asarray(itl_ms), 1e-6)
    return latency.min() / latency
