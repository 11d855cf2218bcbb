"""The predicted-latency scorer: SLO headroom from predicted TTFT and ITL, a score in [0, 1] per candidate.

With SLOs, a candidate's headroom on one target is the share of its SLO left over by the prediction,
`h = 1 − predicted / SLO` (1: no latency at all, 0: exactly at the SLO, negative: a predicted miss). A candidate
predicted to meet both SLOs is scored on its mean headroom, one predicted to miss on its miss, set mostly by
the binding target with the other breaking ties:

    H = (h_ttft + h_itl) / 2                                 if both SLOs are predicted met
    H = 0.9 · min(h_ttft, h_itl) + 0.1 · max(h_ttft, h_itl)   otherwise
    score = clip((1 + H) / 2, 0, 1), and below 0.5 if either SLO is predicted missed

so a candidate predicted to meet both SLOs scores at least 0.5, more the more slack it leaves on either target,
and one predicted to miss scores below 0.5, less the worse the miss. Slack on either target is a margin against
a prediction error, so among candidates that meet both, both count alike; ranked on the binding target alone,
the ITL p90 (wide, as a request's ITL depends on the batches that form while it decodes) chose the endpoint and
its TTFT barely counted: on the large mixed fleet goodput 20.3 against 20.9 requests/s at 85% load and 24.6
against 28.8 at 1.5x, with the TTFT median 0.42 against 0.25 s (3 seeds). The predictions used against SLOs are
the upper quantile (p90 by default): a miss costs a request its SLO while a little more slack costs nothing.
With only one SLO, only that target counts. Without SLOs the score is the lowest predicted latency over the
candidates divided by this one's (1 for the fastest), with the latency of a request taken as its mean TTFT plus
its expected output tokens at the mean ITL.

When every candidate is predicted far inside both SLOs (each upper-quantile prediction within `comfort` of its
SLO, half by default), no candidate risks a miss and the headroom sum mostly ranks noise in the ITL p90; the
request then goes where its mean predicted TTFT is shortest (`comfortable_scores`). That shortens the TTFT tail
at light load (Azure conversation trace, homogeneous fleet: p99 lower in all six cells of three seeds, e.g.
108.0 against 123.8 ms); under the Mooncake trace's load its effect on goodput is mostly within the seeds' noise.
With a tolerance (off by default), means that close count as equal and the candidate sent a request longest ago
wins: near-equal endpoints are taken in turn, as round-robin takes them all.

Either way the score weighs the request at hand only; its prefill also slows every request decoding where it
lands. On unified endpoints the margin above `FEASIBLE` of each candidate predicted in time is divided by
`1 + harm`, the ITL headroom the prefill would take from the requests in flight there (`shared_step_scores`,
`router_plugin.decoding`).
"""

from __future__ import annotations

import numpy as np

FEASIBLE = 0.5
"""Scores at or above this are predicted to meet every SLO the request has."""
SINK = 0.1
"""Scores below this are predicted to miss by about the SLO itself or more (beyond saving)."""
TIE_BREAK = 1e-6
"""Weight of the upper-quantile TTFT where candidates are ranked by their mean TTFT: it orders only candidates whose
means are equal, as means bounded at the same longest wait learned are (`predictor.wait_bound`), while their
upper quantiles, which are not bounded, still tell a short queue from a long one. (Left tied, the first candidate
took them: on the Azure trace's time-sliced fleet at the high load, TTFT p99 331 ms against 263 ms broken by the
upper quantile, three seeds.)"""


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
    [0.8875, 0.7625, 0.315]
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
    met = np.clip((1.0 + (low + high) / 2.0) / 2.0, 0.0, 1.0)
    missed = np.clip((1.0 + 0.9 * low + 0.1 * high) / 2.0, 0.0, np.nextafter(FEASIBLE, 0.0))
    return np.where(low >= 0.0, met, missed)


def latency_scores(
    ttft_ms: np.ndarray, itl_ms: np.ndarray, expected_output_tokens: float, ttft_upper_ms: np.ndarray | None = None
) -> np.ndarray:
    """Scores without SLOs: the fastest candidate scores 1, one twice as slow 0.5 (mean predictions; equal ones
    ordered by `ttft_upper_ms`, see `TIE_BREAK`).

    >>> latency_scores(np.array([100.0, 200.0]), np.array([10.0, 10.0]), 0.0).tolist()
    [1.0, 0.5]
    >>> s = latency_scores(np.array([900.0, 900.0]), np.array([10.0, 10.0]), 0.0, np.array([9000.0, 2000.0]))
    >>> bool(s[1] > s[0])
    True
    """
    latency = np.asarray(ttft_ms) + expected_output_tokens * np.asarray(itl_ms)
    if ttft_upper_ms is not None:
        latency = latency + TIE_BREAK * np.asarray(ttft_upper_ms)
    latency = np.maximum(latency, 1e-6)
    return latency.min() / latency


def comfortable_scores(
    ttft_ms: np.ndarray,
    itl_ms: np.ndarray,
    ttft_mean_ms: np.ndarray,
    ttft_slo_ms: float | None,
    itl_slo_ms: float | None,
    comfort: float,
    tolerance: float = 0.0,
    last_sent_ms: np.ndarray | None = None,
) -> np.ndarray | None:
    """Scores by mean predicted TTFT when every candidate's upper-quantile predictions (`ttft_ms`, `itl_ms`) are
    within `comfort` times both SLOs; None otherwise (then `slo_scores` rank them). The fastest scores 1, one
    twice as slow 0.75: all stay at or above `FEASIBLE`, as all are predicted to meet the SLOs. Equal means are
    ordered by the upper quantile (`TIE_BREAK`).

    With `tolerance` and `last_sent_ms` (when this router last sent each candidate a request), means within
    `tolerance` of the shortest count as equal, and of those the candidate sent a request longest ago scores 1:
    near-equal predictions are taken in turn, as round-robin takes every candidate, rather than the same
    endpoint winning by a difference smaller than the predictions' own error.

    >>> itl, mean = np.array([30.0, 20.0]), np.array([200.0, 400.0])
    >>> comfortable_scores(np.array([400.0, 800.0]), itl, mean, 2000.0, 100.0, 0.5).round(6).tolist()
    [1.0, 0.75]
    >>> tied = comfortable_scores(np.array([900.0, 600.0]), itl, np.array([300.0, 300.0]), 2000.0, 100.0, 0.5)
    >>> bool(tied[1] > tied[0])
    True
    >>> comfortable_scores(np.array([400.0, 1200.0]), itl, mean, 2000.0, 100.0, 0.5)  # one past half the SLO
    >>> near = np.array([100.0, 105.0, 200.0])  # the second within 10% of the first, the third not
    >>> s = comfortable_scores(near, np.full(3, 20.0), near, 2000.0, 100.0, 0.5, 0.1, np.array([50.0, 10.0, 0.0]))
    >>> int(np.argmax(s))  # the third was sent a request longest ago, but is twice as slow
    1
    """
    if comfort <= 0 or ttft_slo_ms is None or itl_slo_ms is None or len(ttft_ms) < 2:
        return None
    if float(np.max(ttft_ms)) > comfort * ttft_slo_ms or float(np.max(itl_ms)) > comfort * itl_slo_ms:
        return None
    mean = np.asarray(ttft_mean_ms, dtype=np.float64) + TIE_BREAK * np.asarray(ttft_ms, dtype=np.float64)
    mean = np.maximum(mean, 1e-6)
    scores = FEASIBLE + (1.0 - FEASIBLE) * mean.min() / mean
    if tolerance <= 0 or last_sent_ms is None:
        return scores
    near = mean <= (1.0 + tolerance) * mean.min()
    turn = int(np.argmin(np.where(near, last_sent_ms, np.inf)))
    return np.where(np.arange(len(scores)) == turn, 1.0, np.minimum(scores, 1.0 - TIE_BREAK))


def shared_step_scores(scores: np.ndarray, harm: np.ndarray) -> np.ndarray:
    """Scores of candidates predicted to meet the SLOs, their margin above `FEASIBLE` divided by `1 + harm`: the
    ITL headroom the request's prefill would take from the requests already decoding there
    (`router_plugin.decoding.decode_harm`). Those predicted to miss keep their scores; no candidate crosses
    `FEASIBLE` either way, so which requests are predicted in time does not change.

    Divided rather than subtracted, the harm never ties the candidates at `FEASIBLE`: a long prompt on a busy
    fleet harms every candidate by more than its margin, and tied there it went to a random one (on the
    time-sliced fleet at 1.28x capacity, 4.98 against 5.18 requests/s over six seeds; divided, 5.14).

    >>> shared_step_scores(np.array([0.9, 0.7, 0.3]), np.array([1.0, 0.0, 5.0])).round(6).tolist()
    [0.7, 0.7, 0.3]
    """
    scores = np.asarray(scores, dtype=np.float64)
    return np.where(scores >= FEASIBLE, FEASIBLE + (scores - FEASIBLE) / (1.0 + harm), scores)


FIT_CHOICES = ("most_slack", "tightest")
"""Which candidate predicted to meet the SLOs wins (`preference`'s `fit`)."""
OVERFLOW_CHOICES = ("auto", "least_bad", "sink")
"""Where a request no candidate is predicted to serve in time goes: `preference`'s `overflow` ("least_bad",
"sink"), or "auto", which a policy turns into one of them by the recent load (`LeadtimeConfig.overflow`)."""


def preference(
    scores: np.ndarray,
    fit: str = "most_slack",
    margin: float = 0.0,
    overflow: str = "least_bad",
    mean_scores: np.ndarray | None = None,
) -> np.ndarray:
    """Turn SLO scores into the value the picker maximises: any candidate predicted to meet the SLOs ranks above
    every one predicted to miss them.

    Among those predicted to meet them, `fit="most_slack"` prefers the most slack; `fit="tightest"` prefers the
    least slack that still leaves `margin` of the binding SLO (keeping the fastest endpoints for the requests
    that need them), and falls back to the most slack when none leaves that much. Among those predicted to miss,
    `overflow="least_bad"` prefers the smallest miss; `overflow="sink"` sends it where the queue is already beyond
    saving, when one is: to the candidate with the largest miss among those scoring below `SINK` (predicted at
    about twice the SLO or more), rather than onto an endpoint that may still serve others in time; with no
    such candidate, the smallest miss. Misses of the SLO itself or more all score 0: `overflow_choice` settles
    such ties, so that what cannot be saved piles up on an overflow endpoint.

    `scores` come from the upper-quantile predictions, `mean_scores` (optional, same candidates) from the mean
    ones. A request is given up (sunk, or tied at 0 for `overflow_choice`) only when no candidate's mean
    predictions meet its SLOs either: missing the p90 by a little still leaves a request more likely than not to
    be served in time, while the overflow endpoint leaves it none. So when no p90 meets the SLOs and some mean
    does, the candidates rank by their mean scores. (Sunk on the p90 alone, a fleet whose ITL p90s all sat just
    above the SLO, twice their mean while the ITL spread is wide, sent 47 requests within 5 s to a 20 s queue at
    85% load; tied on the p90s at 0 and sent to the overflow endpoint, 44% of such requests on the time-sliced
    fleet would have met both SLOs, and the overflow endpoint built a backlog of 100 s.)

    >>> s = np.array([0.9, 0.6, 0.52, 0.3, 0.05])
    >>> int(np.argmax(preference(s))), int(np.argmax(preference(s, fit="tightest", margin=0.1)))
    (0, 1)
    >>> int(np.argmax(preference(s[3:], overflow="sink"))), int(np.argmax(preference(s[3:4], overflow="sink")))
    (1, 0)
    >>> int(np.argmax(preference(s[3:], overflow="sink", mean_scores=np.array([0.7, 0.2]))))  # 3 is savable
    0
    >>> int(np.argmax(preference(np.zeros(2), mean_scores=np.array([0.3, 0.6]))))  # tied on the p90s, not the means
    1
    """
    scores = np.asarray(scores, dtype=np.float64)
    feasible = scores >= FEASIBLE
    if mean_scores is not None and not feasible.any() and float(np.max(mean_scores)) >= FEASIBLE:
        scores = np.where(mean_scores >= FEASIBLE, mean_scores, scores)  # savable: placed by its means
        feasible = scores >= FEASIBLE
    out = scores.copy()
    if fit == "tightest":
        roomy = scores >= FEASIBLE + margin / 2.0
        out = np.where(roomy, 2.0 - scores, out)
    if overflow == "sink":
        hopeless = scores < SINK
        if hopeless.any():
            out = np.where(feasible, out, np.where(hopeless, FEASIBLE - scores - 1e-9, 0.0))
    return out


def overflow_choice(
    ranked: np.ndarray, ttft_ms: np.ndarray, cap_ms: float | None, overflow_rank: np.ndarray | None = None
) -> int:
    """Where a request predicted to miss on every candidate goes, given the picker's values (`preference`).

    A single best value wins. Ties are among candidates beyond saving (their scores clip at 0): with no cap the
    first takes them, one overflow endpoint; with `cap_ms` it takes them only while its predicted TTFT stays
    within the cap, then the next candidate in order within it does, and when none is, the one with the
    shortest predicted TTFT. Unbounded, the overflow endpoint's queue grows for as long as requests beyond
    saving keep coming, and its wait becomes the fleet's TTFT tail (100 s at p99 at 85% load, against about 6 s
    under any spreading router); bounded, that wait stays near the cap.

    "In order" is the candidates' own order, or, with `overflow_rank` (one value per candidate, lower first; equal
    ranks keep the candidates' order), the order an operator chose (`overflowEndpoints`): an endpoint kept spare,
    or one shared with another job, can take what cannot be saved before the endpoints serving in time do.

    >>> ranked = np.array([0.0, 0.0, 0.0])
    >>> overflow_choice(ranked, np.array([5000.0, 9000.0, 4000.0]), None)
    0
    >>> overflow_choice(ranked, np.array([7000.0, 5000.0, 4000.0]), 6000.0)  # the first is past the cap
    1
    >>> overflow_choice(ranked, np.array([7000.0, 8000.0, 6500.0]), 6000.0)  # all are: the shortest wait
    2
    >>> overflow_choice(np.array([0.2, 0.0]), np.array([9000.0, 1000.0]), 6000.0)  # a smaller miss wins outright
    0
    >>> overflow_choice(ranked, np.array([5000.0, 9000.0, 4000.0]), None, np.array([1, 1, 0]))  # the third is named
    2
    """
    tied = np.flatnonzero(ranked >= ranked.max() - 1e-12)
    if overflow_rank is not None and len(tied) > 1:
        tied = tied[np.argsort(overflow_rank[tied], kind="stable")]
    if len(tied) == 1 or cap_ms is None:
        return int(tied[0])
    within = tied[ttft_ms[tied] <= cap_ms]
    return int(within[0]) if len(within) else int(tied[int(np.argmin(ttft_ms[tied]))])
