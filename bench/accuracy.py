"""`leadtime bench accuracy`: Leadtime vs the llm-d reference vs a median floor on real measurements.

Two protocols. Prequential: walk the rows in file order, predict each, then learn it — what a predictor
living in a router experiences. A file in outcome order (a row is written when its outcome is known, as llm-d's
sidecar and the simulator write them) lets that walk learn outcomes a router would not yet have had: with
`label_delay="arrival"` each row is instead predicted at its request's arrival, knowing only the outcomes stamped
by then. Random 90/10 split over several seeds: train on 90% (Leadtime learns the
training rows in file order), predict the rest. MAPE and median APE are of the mean prediction; coverage is the
share of rows whose actual is at or below the upper-quantile prediction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
from rich.progress import Progress
from rich.table import Table

from leadtime.bench.data import RowUsage, actuals, at_line, first_out_of_order, load_llmd_lines
from leadtime.console import report_console
from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError
from leadtime.features.rows import LLMD_MODEL_INPUTS, parse_timestamp
from leadtime.features.vectorize import FeatureBatch, Vectorizer
from leadtime.json_text import print_json
from leadtime.predictor import physics
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.llmd_reference import LlmdFrame, LlmdReference
from leadtime.progress import stderr_bar

TARGETS = ("ttft", "tpot")
MODELS = ("leadtime", "llmd_reference", "median_baseline")


def errors(mean: np.ndarray, upper: np.ndarray, actual: np.ndarray) -> dict[str, float]:
    """MAPE, median APE and upper-quantile coverage over rows that observed the target."""
    mask = actual > 0
    if not mask.any():
        return {"mape": float("nan"), "median_ape": float("nan"), "p90_coverage": float("nan"), "n": 0}
    a = actual[mask]
    ape = np.abs(mean[mask] - a) / a
    return {
        "mape": float(ape.mean()),
        "median_ape": float(np.median(ape)),
        "p90_coverage": float((a <= upper[mask]).mean()),
        "n": int(mask.sum()),
    }


class _MedianBaseline:
    """The floor: the median (and upper quantile) of everything seen so far."""

    def __init__(self, quantile: float) -> None:
        self.quantile = quantile
        self.seen: dict[str, list[float]] = {"ttft": [], "tpot": []}

    def learn(self, target: str, y: float) -> None:
        if y > 0:
            self.seen[target].append(y)

    def predict(self, target: str) -> tuple[float, float]:
        seen = self.seen[target]
        if not seen:
            return 0.0, 0.0
        return float(np.median(seen)), float(np.quantile(seen, self.quantile))


# The load features whose low and high halves each get their own p90 coverage.
LOAD_FEATURES = (
    "num_request_waiting",
    "num_request_running",
    "kv_cache_percentage",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
)
_MIN_HALF_ROWS = 50


def coverage_by_load(x_ref: LlmdFrame, upper: np.ndarray, actual: np.ndarray) -> dict[str, dict[str, float]]:
    """p90 coverage in the low half (at or below the median) and the high half (above it) of each load feature,
    over rows that observed the target; a feature with a half of fewer than 50 rows is left out (a load the
    trace hardly varies)."""
    observed = actual > 0
    out: dict[str, dict[str, float]] = {}
    for name in LOAD_FEATURES:
        values = x_ref.columns[name][observed]
        if len(values) == 0:
            continue
        covered = actual[observed] <= upper[observed]
        low = values <= np.median(values)
        if min(int(low.sum()), int((~low).sum())) < _MIN_HALF_ROWS:
            continue
        out[name] = {"low": float(covered[low].mean()), "high": float(covered[~low].mean())}
    return out


def _extremes(halves: dict[str, dict[str, float]]) -> tuple[float, float]:
    values = [v for h in halves.values() for v in h.values()]
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


Walk = dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]  # model → target → (mean, upper) per row

ARRIVAL: Final = "arrival"
LabelDelay = int | Literal["arrival"]
"""When the walk learns a row's outcome: after that many later rows were predicted, or at its timestamp while rows
are predicted at their requests' arrivals (`ARRIVAL`)."""

Event = tuple[Literal["predict", "learn"], int]
"""One step of a walk: predict row i, or learn row i's outcome. Every walk is such a schedule, so that the models
and the figures cannot tell one walk from another but by what was learned before each prediction."""


def row_delay_schedule(n: int, label_delay: int) -> list[Event]:
    """Rows in file order, row i's outcome learned once row i + `label_delay` was predicted (0: at once).

    >>> row_delay_schedule(3, 1)
    [('predict', 0), ('predict', 1), ('learn', 0), ('predict', 2), ('learn', 1)]
    """
    if label_delay < 0:
        raise ValueError(f"label_delay must be ≥ 0, got {label_delay}")
    events: list[Event] = []
    for i in range(n):
        events.append(("predict", i))
        if i >= label_delay:
            events.append(("learn", i - label_delay))
    return events


def arrival_schedule(arrival: np.ndarray, outcome: np.ndarray) -> list[Event]:
    """Rows predicted in order of their requests' arrivals; before each, every row whose outcome is stamped at or
    before that arrival learned, in the order of the outcomes — what a router has when a request reaches it. Rows
    whose outcome comes after the last arrival are never learned, as the row-delay walk's last rows are not.

    >>> arrival_schedule(np.array([0.0, 1.0, 0.5]), np.array([2.0, 3.0, 0.8]))
    [('predict', 0), ('predict', 2), ('learn', 2), ('predict', 1)]
    """
    learn_order = np.argsort(outcome, kind="stable")
    events: list[Event] = []
    learned = 0
    for i in np.argsort(arrival, kind="stable"):
        while learned < len(learn_order) and outcome[learn_order[learned]] <= arrival[i]:
            events.append(("learn", int(learn_order[learned])))
            learned += 1
        events.append(("predict", int(i)))
    return events


def prediction_order(schedule: list[Event]) -> np.ndarray:
    """The rows in the order the schedule predicts them (its "second half" is the later half of these)."""
    return np.array([i for kind, i in schedule if kind == "predict"], dtype=np.int64)


@dataclass(frozen=True)
class RequestTimes:
    """When each row's request arrived and when its outcome was known, in seconds, as a file's rows tell them."""

    arrival: np.ndarray
    outcome: np.ndarray
    tpot_by_state: int
    """TPOT rows whose TTFT row was found by its identical request and endpoint state (one endpoint serves both)."""
    tpot_by_length: int
    """TPOT rows paired by prompt length alone, with the earliest-stamped TTFT row of that length not yet paired
    (P/D: the TPOT row carries the decode endpoint's state, the TTFT row the prefill endpoint's)."""


_STATE_FIELDS = tuple(f for f in LLMD_MODEL_INPUTS if f != "num_tokens_generated")


def request_times(rows: list[dict[str, Any]], path: Path, lines: list[int]) -> RequestTimes:
    """Each row's request arrival and outcome time, from the rows' timestamps (when the outcome was known).

    A TTFT row's request arrived at its timestamp less its TTFT. llm-d's TPOT row, written at completion, carries
    neither the TTFT nor the number of tokens, so its arrival is its request's TTFT row's: the one stamped before
    it with the same request and endpoint state, else the earliest of the same prompt length not yet paired.
    Raises ValueError naming the line of a row without a timestamp, or of a TPOT row without a TTFT row.
    """
    missing = [i for i, r in enumerate(rows) if r.get("timestamp") is None]
    if len(missing) == len(rows):
        raise ValueError(
            f"{path}: its rows carry no timestamp: --label-delay {ARRIVAL} predicts each row at its request's "
            "arrival (timestamp − actual_ttft_ms) and learns it at its timestamp; give --label-delay a number of "
            "rows instead"
        )
    if missing:
        raise ValueError(
            f"{path}:{lines[missing[0]]}: no timestamp, where other rows have one: --label-delay {ARRIVAL} needs "
            "every row's"
        )
    outcome = np.array([parse_timestamp(r["timestamp"]) for r in rows])
    ttft, tpot = actuals(rows)
    arrival = outcome - ttft / 1e3
    unpaired: dict[int, list[int]] = {}  # prompt length → TTFT rows not yet paired, earliest stamped first
    by_state = by_length = 0
    for i in np.argsort(outcome, kind="stable"):
        row = rows[i]
        if ttft[i] > 0:
            unpaired.setdefault(int(row["input_token_length"]), []).append(int(i))
            continue
        if tpot[i] <= 0:
            continue  # measures nothing: predicted at its timestamp, scored on nothing
        candidates = unpaired.get(int(row["input_token_length"]), [])
        same = [j for j in candidates if all(rows[j].get(f) == row.get(f) for f in _STATE_FIELDS)]
        if same:
            pair, by_state = same[0], by_state + 1
        elif candidates:
            pair, by_length = candidates[0], by_length + 1
        else:
            raise ValueError(
                f"{path}:{lines[i]}: a TPOT row with no TTFT row of its request stamped before it (none of prompt "
                f"length {row['input_token_length']} left unpaired): --label-delay {ARRIVAL} takes a TPOT row's "
                "arrival from its request's TTFT row, llm-d's TPOT row carrying none"
            )
        candidates.remove(pair)
        arrival[i] = arrival[pair]
    return RequestTimes(arrival, outcome, by_state, by_length)


def _first(values: np.ndarray | None) -> float:
    assert values is not None  # the reference trains both objectives here
    return float(values[0])


def prequential_walk(
    x_lt: FeatureBatch,
    x_ref: LlmdFrame,
    y: dict[str, np.ndarray],
    config: LearnerConfig,
    progress: Progress | None,
    reference_model: str | None = None,
    label_delay: int = 0,
    schedule: list[Event] | None = None,
) -> Walk:
    """Every model's (mean, upper) prediction of every row, each made before that row was learned. Leadtime
    gets each row's endpoint where the file names it, as it would from a router.

    With `label_delay` d, row i's outcome is learned only after row i + d was predicted (production: an outcome
    arrives when its request completes, while later requests are being routed); a `schedule` (`arrival_schedule`)
    replaces that order. Every model gets the same walk.
    """
    n = len(x_lt)
    if schedule is None:
        schedule = row_delay_schedule(n, label_delay)
    preds = {m: {t: (np.zeros(n), np.zeros(n)) for t in TARGETS} for m in MODELS}
    leadtime = OnlinePredictor(config)
    reference = LlmdReference(model=reference_model, quantile=config.quantile)
    floor = _MedianBaseline(config.quantile)
    task = progress.add_task("prequential walk", total=n) if progress else None
    for kind, i in schedule:
        if kind == "learn":
            leadtime.learn_many(x_lt[i : i + 1], y["ttft"][i : i + 1], y["tpot"][i : i + 1])
            reference.learn_many(x_ref.take(np.arange(i, i + 1)))
            for t in TARGETS:
                floor.learn(t, float(y[t][i]))
            continue
        p = leadtime.predict_many(x_lt[i : i + 1])
        preds["leadtime"]["ttft"][0][i], preds["leadtime"]["ttft"][1][i] = p.ttft_mean[0], p.ttft_quantile[0]
        preds["leadtime"]["tpot"][0][i], preds["leadtime"]["tpot"][1][i] = p.tpot_mean[0], p.tpot_quantile[0]
        ref = reference.predict_many(x_ref.take(np.arange(i, i + 1)))
        for t in TARGETS:
            preds["llmd_reference"][t][0][i] = _first(ref.get(t, "mean"))
            preds["llmd_reference"][t][1][i] = _first(ref.get(t, "quantile"))
            fm, fu = floor.predict(t)
            preds["median_baseline"][t][0][i], preds["median_baseline"][t][1][i] = fm, fu
        if progress and task is not None:
            progress.advance(task)
    leadtime.close()
    return preds


def summarize_walk(
    preds: Walk, y: dict[str, np.ndarray], x_ref: LlmdFrame | None = None, order: np.ndarray | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """MAPE, median APE and coverage over the walk and its second half (the later half of the rows in the order
    they were predicted, `order`; by default the file's); with `x_ref`, coverage by load half."""
    n = len(y["ttft"])
    later = (np.arange(n) if order is None else order)[n // 2 :]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for m in MODELS:
        out[m] = {}
        for t in TARGETS:
            mean, upper = preds[m][t]
            whole = errors(mean, upper, y[t])
            second = errors(mean[later], upper[later], y[t][later])
            if x_ref is not None:
                halves = coverage_by_load(x_ref, upper, y[t])
                low, high = _extremes(halves)
                out[m][t] = {
                    "prequential_p90_coverage_by_load": halves,
                    "prequential_p90_coverage_by_load_min": low,
                    "prequential_p90_coverage_by_load_max": high,
                }
            else:
                out[m][t] = {}
            out[m][t] |= {
                "prequential_mape": whole["mape"],
                "prequential_median_ape": whole["median_ape"],
                "prequential_p90_coverage": whole["p90_coverage"],
                "prequential_mape_second_half": second["mape"],
                "prequential_p90_coverage_second_half": second["p90_coverage"],
            }
    return out


def _split(
    x_lt: FeatureBatch,
    x_ref: LlmdFrame,
    y: dict[str, np.ndarray],
    config: LearnerConfig,
    seeds: int,
    progress: Progress | None,
    reference_model: str | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    n = len(x_lt)
    per_seed: dict[str, dict[str, list[dict[str, float]]]] = {m: {t: [] for t in TARGETS} for m in MODELS}
    # Leadtime's upper predictions and actuals of every seed's test rows, for coverage by load half.
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {t: [] for t in TARGETS}
    task = progress.add_task("90/10 splits", total=seeds) if progress else None
    for seed in range(seeds):
        order = np.random.default_rng(seed).permutation(n)
        cut = int(round(0.9 * n))
        train, test = np.sort(order[:cut]), np.sort(order[cut:])
        leadtime = OnlinePredictor(config)
        leadtime.learn_many(x_lt[train], y["ttft"][train], y["tpot"][train])
        if config.retrain:  # the trees fitted on all the training rows, as the walk's retrains fit them
            leadtime.retrain_now()
        p = leadtime.predict_many(x_lt[test])
        leadtime.close()
        lt = {"ttft": (p.ttft_mean, p.ttft_quantile), "tpot": (p.tpot_mean, p.tpot_quantile)}
        reference = LlmdReference(model=reference_model, quantile=config.quantile)
        reference.fit(x_ref.take(train))
        ref = reference.predict_many(x_ref.take(test))
        for t in TARGETS:
            per_seed["leadtime"][t].append(errors(*lt[t], y[t][test]))
            pooled[t].append((test, lt[t][1], y[t][test]))
            ref_mean, ref_upper = ref.get(t, "mean"), ref.get(t, "quantile")
            assert ref_mean is not None and ref_upper is not None
            per_seed["llmd_reference"][t].append(errors(ref_mean, ref_upper, y[t][test]))
            seen = y[t][train][y[t][train] > 0]
            median, upper = (np.median(seen), np.quantile(seen, config.quantile)) if len(seen) else (0.0, 0.0)
            floor = (np.full(len(test), median), np.full(len(test), upper))
            per_seed["median_baseline"][t].append(errors(*floor, y[t][test]))
        if progress and task is not None:
            progress.advance(task)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for m in MODELS:
        out[m] = {}
        for t in TARGETS:
            runs = per_seed[m][t]
            out[m][t] = {
                "split_mape": float(np.mean([r["mape"] for r in runs])),
                "split_median_ape": float(np.mean([r["median_ape"] for r in runs])),
                "split_p90_coverage": float(np.mean([r["p90_coverage"] for r in runs])),
            }
    for t in TARGETS:
        # Over the test rows of every seed together: a single seed's 10% is too few rows for two halves.
        if pooled[t]:
            rows = np.concatenate([p[0] for p in pooled[t]])
            upper, actual = np.concatenate([p[1] for p in pooled[t]]), np.concatenate([p[2] for p in pooled[t]])
            by_load = coverage_by_load(x_ref.take(rows), upper, actual)
        else:
            by_load = {}
        low, high = _extremes(by_load)
        out["leadtime"][t] |= {
            "split_p90_coverage_by_load": by_load,
            "split_p90_coverage_by_load_min": low,
            "split_p90_coverage_by_load_max": high,
        }
    return out


def _speed(
    x: FeatureBatch, y: dict[str, np.ndarray], config: LearnerConfig, calls: int = 2000, learns: int = 3000
) -> dict[str, Any]:
    """In-process latency of predict_many on 100 rows and of learning one observation.

    Prediction is timed on a predictor that walked the whole file (with whatever trees it accepted, if it fits
    any); learning is timed as the service runs the learner, retraining in its background thread rather than
    inside learn_many.
    """
    predictor = OnlinePredictor(config)
    predictor.learn_many(x, y["ttft"], y["tpot"])
    if config.retrain:
        predictor.retrain_now()
    trees = predictor.status()["trees_active"]
    rng = np.random.default_rng(0)
    batches = [x[rng.choice(len(x), 100)] for _ in range(50)]
    timings = []
    for i in range(calls):
        batch = batches[i % len(batches)]
        start = time.perf_counter()
        predictor.predict_many(batch)
        timings.append(time.perf_counter() - start)
    predictor.close()
    predictor = OnlinePredictor(replace(config, background=True)).start()
    learn = []
    for i in range(min(len(x), learns)):
        row = x[i : i + 1]
        start = time.perf_counter()
        predictor.learn_many(row, y["ttft"][i : i + 1], y["tpot"][i : i + 1])
        learn.append(time.perf_counter() - start)
    # Batches of 1,000, as the service's ingest loop hands them over.
    batch_seconds, batch_rows = 0.0, 0
    for start_row in range(0, len(x) - 999, 1000):
        sl = slice(start_row, start_row + 1000)
        start = time.perf_counter()
        predictor.learn_many(x[sl], y["ttft"][sl], y["tpot"][sl])
        batch_seconds += time.perf_counter() - start
        batch_rows += 1000
    predictor.close()
    us = np.array(timings) * 1e6
    learn_us = np.array(learn) * 1e6
    return {
        "predict_100_us_p50": float(np.percentile(us, 50)),
        "predict_100_us_p99": float(np.percentile(us, 99)),
        "learn_one_us_p50": float(np.percentile(learn_us, 50)),
        "learn_one_per_s": float(len(learn_us) / (learn_us.sum() / 1e6)),
        "learn_batch_per_s": float(batch_rows / batch_seconds) if batch_seconds else float("nan"),
        "trees_serving_during_predict": trees,
    }


MIN_ROWS = 20
"""Fewer rows leave a 90/10 split a test set of one or two: figures, but of nothing."""

LARGEST_ACTUAL_MS = float(np.finfo(np.float32).max)
"""The largest actual the llm-d reference's trees can learn: XGBoost holds labels as float32 and refuses a larger
one in its native stack trace (`Label contains NaN, infinity or a value too large`), naming no row."""


def check_actuals_fit(y: dict[str, np.ndarray], path: Path, lines: list[int]) -> None:
    """ValueError naming the line and field of the first actual too large for the reference (`LARGEST_ACTUAL_MS`):
    the row check takes any finite number, and Leadtime's guard only sets such a row aside."""
    for target, actual in y.items():
        beyond = np.flatnonzero(actual > LARGEST_ACTUAL_MS)
        if len(beyond):
            i = int(beyond[0])
            raise ValueError(
                f"{path}:{lines[i]}: actual_{target}_ms: {actual[i]:g} is more than the llm-d reference's trees can "
                f"learn (at most {LARGEST_ACTUAL_MS:.3g}; a latency in milliseconds is far below that)"
            )


def run_accuracy(
    data: Path,
    accelerator: str,
    model: str,
    seeds: int = 10,
    progress: bool = True,
    speed_calls: int = 2000,
    reference_model: str | None = None,
    label_delay: LabelDelay = 0,
    on_usage: Callable[[RowUsage], None] | None = None,
    catalog: Catalog = BUILT_IN,
    trees: bool = True,
) -> dict[str, Any]:
    """The report of every model on the file's rows. `accelerator` and `model` are the hardware of rows that name
    none (llm-d's never do), of `catalog`'s classes and models; the report gives what the rows were taken as.
    `on_usage` is told how many rows measure each target before the runs. `label_delay` is the prequential walk's
    (`LabelDelay`); the 90/10 split does not depend on it. `trees` False: Leadtime without its residual trees
    (its online parts alone, in the walk and the split), to see what the trees are worth."""
    rows, lines = load_llmd_lines(data)
    if len(rows) < MIN_ROWS:
        raise ValueError(f"{data}: {len(rows)} rows; the walk and the 90/10 split need at least {MIN_ROWS}")
    times = request_times(rows, data, lines) if label_delay == ARRIVAL else None
    if isinstance(label_delay, int) and label_delay >= len(rows):
        raise ValueError(
            f"--label-delay {label_delay} is not below the {len(rows)} rows of {data}: nothing would be learned"
        )
    ttft, tpot = actuals(rows)
    check_actuals_fit({"ttft": ttft, "tpot": tpot}, data, lines)
    usage = RowUsage.of(ttft, tpot)
    if usage.neither == usage.rows:
        raise ValueError(
            f"{data}: none of its {len(rows)} rows has an actual_ttft_ms or actual_tpot_ms above 0: nothing to measure"
        )
    config = LearnerConfig(accelerator=accelerator, model=model, background=False, catalog=catalog, retrain=trees)
    try:
        x_lt = Vectorizer(accelerator, model, catalog).batch_llmd(rows)
    except FeatureError as err:
        raise at_line(err, data, lines) from None
    # What Leadtime's poisoning guard will not learn (the peers learn every row): latencies in seconds look so.
    guarded = np.flatnonzero(physics.implausible(x_lt.X, ttft, tpot))
    if len(guarded):
        usage = replace(usage, implausible=len(guarded), first_implausible_line=lines[int(guarded[0])])
    backwards = first_out_of_order(rows)
    if backwards is not None:
        usage = replace(usage, out_of_order_line=lines[backwards])
    if on_usage is not None:
        on_usage(usage)
    x_ref = LlmdFrame.from_rows(rows)
    y = {"ttft": ttft, "tpot": tpot}
    if times is not None:
        schedule = arrival_schedule(times.arrival, times.outcome)
    else:
        assert isinstance(label_delay, int)
        schedule = row_delay_schedule(len(rows), label_delay)
    with stderr_bar() as bar:
        walk = prequential_walk(x_lt, x_ref, y, config, bar if progress else None, reference_model, schedule=schedule)
        preq = summarize_walk(walk, y, x_ref, prediction_order(schedule))
        split = _split(x_lt, x_ref, y, config, seeds, bar if progress else None, reference_model)
    report: dict[str, Any] = {m: {t: {**preq[m][t], **split[m][t]} for t in TARGETS} for m in MODELS}
    report["speed"] = _speed(x_lt, y, config, calls=speed_calls, learns=int(1.5 * speed_calls))
    report["data"] = {
        "path": str(data),
        "rows": len(rows),
        "accelerator": taken_as(rows, "accelerator", accelerator),
        "model": taken_as(rows, "model", model),
        "label_delay": label_delay,
        "trees": trees,
        "implausible": usage.implausible,
    }
    if times is not None:
        report["data"]["tpot_arrival_from_ttft_row"] = {
            "same_state": times.tpot_by_state,
            "same_prompt_length": times.tpot_by_length,
        }
    report["reference"] = reference_settings(reference_model)
    return report


def taken_as(rows: list[dict[str, Any]], field: str, default: str) -> str:
    """What the rows' `field` (accelerator or model) was taken as: each row's own where it names one, `default`
    (the command's option) where it does not; several, comma-separated.

    >>> taken_as([{"model": "llama-3.1-8b"}, {}], "model", "qwen3-32b"), taken_as([{}], "model", "qwen3-32b")
    ('llama-3.1-8b, qwen3-32b', 'qwen3-32b')
    """
    return ", ".join(sorted({row.get(field) or default for row in rows}))


def reference_settings(reference_model: str | None) -> dict[str, Any]:
    """How the llm-d reference ran, for the report."""
    ref = LlmdReference(model=reference_model)
    return {
        "model_type": ref.model_type,
        "retrain_every_rows": ref.retrain_every,
        "bucket_size": ref.bucket_size,
        "test_share": ref.test_share,
        "ensemble_min_rows": ref.ensemble_min_rows if ref.ensemble else None,
    }


def _figure(value: float) -> str:
    """A figure of the human-readable report; "–" where there was nothing to measure (no rows of that target)."""
    return "–" if math.isnan(value) else f"{value:.3f}"


def _coverage_range(r: dict[str, float], kind: str) -> str:
    low, high = r[f"{kind}_p90_coverage_by_load_min"], r[f"{kind}_p90_coverage_by_load_max"]
    return "–" if math.isnan(low) else f"{low:.3f}–{high:.3f}"


def print_report(report: dict[str, Any], as_json: bool, usage: RowUsage | None = None) -> None:
    """The report as JSON, or as a table and the lines below it (with `usage`, how many rows each target used)."""
    if as_json:
        print_json(report, indent=2)
        return
    data = report["data"]
    reference = report["reference"]["model_type"]
    trees = "" if data.get("trees", True) else "; leadtime without trees"
    table = Table(title=f"accuracy on {data['path']} ({data['rows']} rows; llmd_reference: {reference}{trees})")
    for column in ("model", "target", "preq MAPE", "2nd-half MAPE", "preq p90 cov", "split MAPE", "split p90 cov"):
        table.add_column(column)
    columns = (
        "prequential_mape",
        "prequential_mape_second_half",
        "prequential_p90_coverage",
        "split_mape",
        "split_p90_coverage",
    )
    for m in MODELS:
        for t in TARGETS:
            table.add_row(m, t, *(_figure(report[m][t][c]) for c in columns))
    console = report_console()
    console.print(table)
    if usage is not None:
        console.print(f"{usage.describe()}; taken as {data['accelerator']} serving {data['model']}", highlight=False)
    if data["label_delay"] == ARRIVAL:
        paired = data["tpot_arrival_from_ttft_row"]
        console.print(
            "prequential walk: each row predicted at its request's arrival, knowing the outcomes stamped by then "
            f"(a TPOT row's arrival is its TTFT row's: {paired['same_state']} found by request and endpoint state, "
            f"{paired['same_prompt_length']} by prompt length alone)",
            highlight=False,
        )
    for t in TARGETS:
        r = report["leadtime"][t]
        console.print(
            f"Leadtime {t} p90 coverage in the low and high halves of each load feature: prequential "
            f"{_coverage_range(r, 'prequential')}, split {_coverage_range(r, 'split')}"
        )
    s = report["speed"]
    batch = s["learn_batch_per_s"]
    console.print(
        f"predict 100 rows: p50 {s['predict_100_us_p50']:.0f} µs, p99 {s['predict_100_us_p99']:.0f} µs; "
        f"learn one: p50 {s['learn_one_us_p50']:.1f} µs ({s['learn_one_per_s']:.0f}/s); "
        f"learn in batches of 1,000: {'– (under 1,000 rows)' if math.isnan(batch) else f'{batch:.0f}/s'}"
    )
