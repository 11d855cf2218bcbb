"""The physics prior and the log-space features the online correction learns on.

TTFT ≈ overhead + (prefill work queued ahead + the request's own uncached prefill) at achieved FLOP/s, plus any
wait for a time-sliced accelerator to become resident; ITL ≈ one decode step, i.e. (weights + KV of the running
batch) at achieved memory bandwidth. The prior is in milliseconds from the roofline columns that
features.vectorize computes, so it already scales with accelerator class, model and tensor parallelism; what it
gets wrong (kernel efficiency, scheduler overheads, queueing) is learned as a multiplicative correction.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leadtime.features.vectorize import COLUMN_INDEX

TARGETS = ("ttft", "tpot")
# The floor of every log of a latency or a prior in ms: the correction's log_prior, the trees' and the log target.
# No real TTFT or ITL is below it, nor any prior of the catalog's hardware (the least, an MI300X serving an 8B
# model at tensor parallelism 16, is 0.2 ms); only absurd hardware (tensor parallelism 1024) has a prior below it.
MIN_MS = 0.05

_C = COLUMN_INDEX


def own_prefill_ms(x: np.ndarray) -> np.ndarray:
    """The request's own uncached prefill at the roofline, with nothing queued ahead of it."""
    return x[:, _C["roofline_own_prefill_ms"]]


def _queue_terms(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The prefill queued ahead of the request at the roofline: the tokens in flight, and the waiting requests,
    each at least one weight pass of prefill."""
    return x[:, _C["roofline_queue_prefill_ms"]], x[:, _C["num_request_waiting"]] * x[:, _C["roofline_weights_ms"]]


def queue_ahead_ms(x: np.ndarray) -> np.ndarray:
    """The prior's time for the queue ahead of the request (`_queue_terms`)."""
    queued, waiting = _queue_terms(x)
    return queued + waiting


def ttft_prior_ms(x: np.ndarray) -> np.ndarray:
    """Physics TTFT without the time-slice wait (added outside the multiplicative correction): its own prefill
    after the queue ahead of it, and one decode step to emit the token."""
    queued, waiting = _queue_terms(x)
    return own_prefill_ms(x) + queued + waiting + x[:, _C["roofline_decode_step_ms"]]


def tpot_prior_ms(x: np.ndarray) -> np.ndarray:
    """Physics TPOT: one decode step of the running batch plus this request."""
    return x[:, _C["roofline_decode_step_ms"]]


def prior_ms(target: str, x: np.ndarray) -> np.ndarray:
    """The physics prior of `target` ("ttft" or "tpot") for every row."""
    return ttft_prior_ms(x) if target == "ttft" else tpot_prior_ms(x)


def additive_ms(target: str, x: np.ndarray) -> np.ndarray:
    """Latency that adds to the prediction unscaled: waiting for a time-sliced accelerator to come back."""
    if target == "ttft":
        return x[:, _C["timeslice_wait_ms"]]
    return np.zeros(len(x))


_LOG_COLUMNS = {
    "ttft": (
        "num_request_waiting",
        "num_request_running",
        "uncached_tokens",
        "prefix_hit_tokens",
        "prefill_tokens_in_flight",
        "decode_tokens_in_flight",
        "num_tokens_generated",
    ),
    "tpot": (
        "num_request_running",
        "num_request_waiting",
        "input_tokens",
        "prefill_tokens_in_flight",
        "decode_tokens_in_flight",
        "num_tokens_generated",
    ),
}
_LINEAR_COLUMNS = ("kv_cache_percentage", "role_prefill", "role_decode")
# The time-slice state enters φ as "switched out" (1 − `timeslice_resident`), 0 on every ordinary row as the roles
# are: a column that is 1 on them is the bias again, the RLS split the learned intercept between the two, and a
# switched-out row with no stated wait lost half of it (~43% faster than the same row resident, after 2,000
# resident rows). At 0, a state never learned leaves the prediction where it was.
TIMESLICE_AWAY = "timeslice_away"
# What builds before it wrote in its place (`convert_resident_column`).
_TIMESLICE_RESIDENT = "timeslice_resident"


def correction_feature_names(target: str) -> list[str]:
    """Names of φ's columns for `target`, in order."""
    return (
        ["bias", "log_prior"] + [f"log1p_{c}" for c in _LOG_COLUMNS[target]] + list(_LINEAR_COLUMNS) + [TIMESLICE_AWAY]
    )


def correction_features(target: str, x: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """φ(x): the design matrix of the online linear correction on log(actual / prior)."""
    log_idx, lin_idx = _LOG_INDEX[target], _LINEAR_INDEX
    k = len(log_idx)
    phi = np.empty((len(x), 3 + k + len(lin_idx)))
    phi[:, 0] = 1.0
    np.log(np.maximum(prior, MIN_MS), out=phi[:, 1])
    phi[:, 1] -= _LOG_10
    np.log1p(x.take(log_idx, axis=1), out=phi[:, 2 : 2 + k])
    phi[:, 2 + k : -1] = x.take(lin_idx, axis=1)
    np.subtract(1.0, x[:, _RESIDENT], out=phi[:, -1])
    return phi


def convert_resident_column(names: list[str], rls: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """A saved correction (its names and `RecursiveLeastSquares.to_dict`) with the `timeslice_resident` column of
    older builds as one with `TIMESLICE_AWAY` that predicts and learns the same. With away = 1 − resident,
    φ_old = A φ_new, A the identity but for the row resident = bias − away; so w_new = Aᵀ w_old (the bias takes
    b + w, away −w) and P_new = Aᵀ P_old A. Any other names come back as they were, for the caller to judge.

    >>> names, rls = convert_resident_column(["bias", "timeslice_resident"], {"weights": [0.5, 0.5], "p": np.eye(2)})
    >>> names, rls["weights"], rls["p"]
    (['bias', 'timeslice_away'], [1.0, -0.5], [[2.0, -1.0], [-1.0, 1.0]])
    """
    if not isinstance(names, list) or _TIMESLICE_RESIDENT not in names or names[0] != "bias":
        return names, rls
    column = names.index(_TIMESLICE_RESIDENT)
    a = np.eye(len(names))
    a[column, 0], a[column, column] = 1.0, -1.0
    weights, p = np.asarray(rls["weights"], dtype=np.float64), np.asarray(rls["p"], dtype=np.float64)
    converted = {**rls, "weights": (a.T @ weights).tolist(), "p": (a.T @ p @ a).tolist()}
    return [TIMESLICE_AWAY if n == _TIMESLICE_RESIDENT else n for n in names], converted


_LOG_10 = float(np.log(10.0))
# Index arrays, not lists: numpy converts a list on every call.
_LOG_INDEX = {t: np.array([_C[c] for c in cols], dtype=np.intp) for t, cols in _LOG_COLUMNS.items()}
_LINEAR_INDEX = np.array([_C[c] for c in _LINEAR_COLUMNS], dtype=np.intp)
_RESIDENT = _C["timeslice_resident"]


# The poisoning guard. An observation this far below what the hardware can physically do, or above a day, is not a
# measurement (a unit mix-up, a broken client, someone feeding the learner on purpose): the learner drops it, and
# the service counts it (`ingestion.dropped.implausible`, `leadtime_observations_lost_total{reason="implausible"}`).
IMPLAUSIBLY_FAST = 100.0
IMPLAUSIBLY_SLOW_MS = 86_400_000.0


def floor_ms(target: str, x: np.ndarray) -> np.ndarray:
    """The least time `target` can take on the row's hardware by the roofline: a first token needs one pass over
    the weights (not the prompt's prefill: a prefix score that under-reports cache hits, or the decode side of a
    P/D pair, legitimately answers far below it); a next token needs one decode step of the running batch."""
    column = "roofline_weights_ms" if target == "ttft" else "roofline_decode_step_ms"
    return x[:, _C[column]]


def implausible(x: np.ndarray, actual_ttft_ms: np.ndarray, actual_tpot_ms: np.ndarray) -> np.ndarray:
    """Rows whose observed TTFT or TPOT (0 = not observed) is over `IMPLAUSIBLY_FAST` times below its roofline floor,
    or above `IMPLAUSIBLY_SLOW_MS`.

    >>> from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
    >>> from leadtime.features.vectorize import Vectorizer
    >>> x = Vectorizer().batch([FeatureRow(RequestFeatures(1000), EndpointState())] * 3).X
    >>> implausible(x, np.array([80.0, 0.001, 0.0]), np.array([12.0, 12.0, 1e9])).tolist()
    [False, True, True]
    """
    bad = np.zeros(len(x), dtype=bool)
    with np.errstate(over="ignore"):  # 1e308 × 100 is inf, and above a day all the same
        for target, actual in (("ttft", actual_ttft_ms), ("tpot", actual_tpot_ms)):
            observed = actual > 0
            bad |= observed & ((actual * IMPLAUSIBLY_FAST < floor_ms(target, x)) | (actual > IMPLAUSIBLY_SLOW_MS))
    return bad


def wait_overstated(x: np.ndarray, actual_ttft_ms: np.ndarray) -> np.ndarray:
    """Rows whose observed TTFT (0 = not observed) leaves, after the time-slice wait the row states, less than the
    poisoning guard takes from any row (over `IMPLAUSIBLY_FAST` times below the floor): the stated wait, an
    expectation of when the accelerator comes back, was longer than the real one.

    >>> from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
    >>> from leadtime.features.vectorize import Vectorizer
    >>> parked = EndpointState(timeslice_state="parked", timeslice_wait_ms=5000.0)
    >>> x = Vectorizer().batch([FeatureRow(RequestFeatures(1000), parked)] * 3).X
    >>> wait_overstated(x, np.array([4000.0, 5080.0, 0.0])).tolist()
    [True, False, False]
    """
    left = actual_ttft_ms - additive_ms("ttft", x)
    with np.errstate(over="ignore"):  # a wait near a double's limit: -1.7e308 × 100 is -inf, overstated all the same
        return (actual_ttft_ms > 0) & (left * IMPLAUSIBLY_FAST < floor_ms("ttft", x))
