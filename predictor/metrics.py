"""Prometheus metrics of one service instance, on a registry of its own (never the process-global one).

Two apps in one process (tests, two replicas) must not share counters, so every app builds a `ServiceMetrics`.
Names follow Prometheus conventions: `leadtime_` prefix, base units (seconds, ratios), counters end in
`_total`. Values that live elsewhere (store counters, model version and age, window size) are read at
scrape time by a collector, so the hot path never updates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.model_pull import PULL_RESULTS

LATENCY_BUCKETS = (
    0.0001,
    0.0002,
    0.0003,
    0.0005,
    0.00075,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
RETRAIN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RETRAIN_OUTCOMES = ("accepted", "rejected", "failed")
APIS = ("llmd", "native", "grpc")
"""The `api` label of predictions and observations: llm-d's paths, the native /v1 API, gRPC."""
GRPC_METHODS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["Predictor"].methods)
"""The `method` label of the gRPC metrics: every method of leadtime.v1.Predictor, as the proto defines them."""
GRPC_CLIENT_STREAMS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["Predictor"].methods if m.client_streaming)
"""The methods whose calls are client streams: timed for the stream's whole life, as long as its client sends."""
UNMATCHED_PATH = "unmatched"
"""The `path` label of a request no route matched (the service's and the gateway's 404s): one series for them all,
not one per path a client mistyped or a scanner tried."""


def expose_without_created_series() -> None:
    """Drop the `_created` sample prometheus_client writes beside every counter and histogram series: Prometheus's
    text format has no created timestamps, so each became a series of its own (a sixth of the samples, per
    endpoint at the gateway), offered in Grafana's metric browser beside the real ones and read by no dashboard or
    alert. Process-wide in prometheus_client: called by the commands that own their process (`leadtime serve`,
    `leadtime route`), not on import, so that a program embedding Leadtime keeps its own series as they were."""
    disable_created_metrics()


class _LiveValues(Collector):
    """Reads current values from the service when scraped."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        v = self._read()
        version = GaugeMetricFamily("leadtime_model_version", "Version of the model serving now.")
        version.add_metric([], v.get("model_version", 0))
        yield version
        age = GaugeMetricFamily(
            "leadtime_model_age_seconds",
            "Seconds since the serving model last changed (a retrain that won, trees installed by the retraining "
            "job), as its artifact records, so restarts do not reset it; since start-up if it never has.",
        )
        age.add_metric([], v.get("model_age_seconds", float("nan")))
        yield age
        if "quantile" in v:
            quantile = GaugeMetricFamily(
                "leadtime_model_quantile",
                "The upper quantile the service predicts (0.9 = p90): the share of actuals it should cover.",
            )
            quantile.add_metric([], v["quantile"])
            yield quantile
        store_up = GaugeMetricFamily(
            "leadtime_store_up",
            "1 while a component of the store answers, 0 while it does not: redis with a Redis store "
            "(its outage buffers observations in memory), store for the in-memory one (always 1).",
            labels=["component"],
        )
        for component, up in v.get("store_up", {}).items():
            store_up.add_metric([component], up)
        yield store_up
        window = GaugeMetricFamily("leadtime_window_samples", "Samples in the retraining window.", labels=["target"])
        for target, n in v.get("window", {}).items():
            window.add_metric([target], n)
        yield window
        learned = GaugeMetricFamily(
            "leadtime_model_observations",
            "Observations the serving model has learned from (after adopting a published model, the publisher's too).",
            labels=["target"],
        )
        for target, n in v.get("learned", {}).items():
            learned.add_metric([target], n)
        yield learned
        buffered = GaugeMetricFamily(
            "leadtime_observations_buffered",
            "Observations waiting in memory for the shared store to come back.",
        )
        buffered.add_metric([], v.get("buffered", 0))
        yield buffered
        ingestion = v.get("ingestion")
        if ingestion:
            replayed = CounterMetricFamily(
                "leadtime_observations_replayed",
                "Observations an earlier process accepted into the shared stream that this one read back at start "
                "to learn (not in accepted_total): with one replica, accepted + replayed = learned + thinned + lost "
                "+ pending.",
            )
            replayed.add_metric([], ingestion["replayed"])
            yield replayed
            learned_rows = CounterMetricFamily(
                "leadtime_observations_learned",
                "Observations this process's learner has learned (model and window; one learned again after a model "
                "was adopted counts again): /status ingestion.learned_here.",
            )
            learned_rows.add_metric([], ingestion["learned_here"])
            yield learned_rows
            thinned = CounterMetricFamily(
                "leadtime_observations_thinned",
                "Accepted observations left unlearned to keep up with overload, evenly over time.",
                labels=["reason"],
            )
            for reason, n in ingestion["thinned"].items():
                thinned.add_metric([reason], n)
            yield thinned
            # The one count of accepted rows lost, by reason: a total beside it would count each loss twice.
            reasons = CounterMetricFamily(
                "leadtime_observations_lost",
                "Accepted observations that will not be learned, by reason (backlog_full, store_bound: the "
                "embedded store; store_buffer: the Redis outage buffer; invalid; implausible: the poisoning guard; "
                "flushed: by /flush before they were learned).",
                labels=["reason"],
            )
            for reason, n in ingestion["dropped"].items():
                reasons.add_metric([reason], n)
            yield reasons
            pending = GaugeMetricFamily(
                "leadtime_observations_pending",
                "Accepted observations waiting to be learned (in the store or the learner).",
            )
            pending.add_metric([], ingestion["pending"])
            yield pending
            one_in = GaugeMetricFamily(
                "leadtime_ingestion_learning_one_in", "Thinning: 1 = every accepted row is learned, n = one in n."
            )
            one_in.add_metric([], ingestion["learning_one_in"])
            yield one_in


class ServiceMetrics:
    """Every metric the service exports, on a fresh CollectorRegistry."""

    def __init__(self, read_live: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "leadtime_http_requests",
            "HTTP requests by route, method and status.",
            ["path", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "leadtime_http_request_duration_seconds",
            "HTTP request latency by route.",
            ["path"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grpc_requests = Counter(
            "leadtime_grpc_requests", "gRPC calls by method and status code.", ["method", "code"], registry=r
        )
        self.grpc_seconds = Histogram(
            "leadtime_grpc_request_duration_seconds",
            "gRPC call latency by method.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.predictions = Counter(
            "leadtime_predictions", f"Rows predicted, by API ({', '.join(APIS)}).", ["api"], registry=r
        )
        self.observations_accepted = Counter(
            "leadtime_observations_accepted", "Observations accepted, by API.", ["api"], registry=r
        )
        self.observations_rejected = Counter(
            "leadtime_observations_rejected",
            "Observations refused as invalid (a whole batch counts).",
            ["api"],
            registry=r,
        )
        # Exported at 0 from the start: rate() and increase() count a counter's steps, so a series that appeared
        # with its first call would never show that call (nor the rest of its burst) on a dashboard or in an alert.
        for api in APIS:
            for family in (self.predictions, self.observations_accepted, self.observations_rejected):
                family.labels(api)
        import grpc  # here: the gateway imports this module for its constants, and has no use for grpc

        for method in GRPC_METHODS:  # every status code, not OK alone: the first refusals are what an alert is for
            for code in grpc.StatusCode:
                self.grpc_requests.labels(method, code.name)
            self.grpc_seconds.labels(method)
        self.live_error = Histogram(
            "leadtime_live_absolute_percentage_error_ratio",
            "|predicted mean − actual| ÷ actual for each observed decision (0.1 = 10%).",
            ["target", "accelerator", "role"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.quantile_checks = Counter(
            "leadtime_live_quantile_checks",
            'Observed decisions whose predicted upper quantile was checked; covered="true" if actual ≤ it.',
            ["target", "accelerator", "role", "covered"],
            registry=r,
        )
        self._coverage_keys: set[tuple[str, str, str]] = set()
        self.retrain_seconds = Histogram(
            "leadtime_retrain_duration_seconds",
            "Wall time of a retrain of both targets.",
            buckets=RETRAIN_BUCKETS,
            registry=r,
        )
        self.retrains = Counter(
            "leadtime_retrains",
            "Retrain outcomes per target: accepted, rejected or failed.",
            ["target", "outcome"],
            registry=r,
        )
        for target in ("ttft", "tpot"):  # exported at 0 from the start: a dashboard sees "none yet", not no data
            for outcome in RETRAIN_OUTCOMES:
                self.retrains.labels(target, outcome)
        self.model_swaps = Counter(
            "leadtime_model_swaps", "Models swapped in from the shared registry or a reload.", registry=r
        )
        self.model_pulls = Counter(
            "leadtime_model_pulls",
            "Pulls of --model-from's model, by result: new (taken), unchanged, error (no model from the source), "
            "refused (what it sent).",
            ["result"],
            registry=r,
        )
        for result in PULL_RESULTS:  # exported at 0 from the start: an alert on failing pulls has a series to read
            self.model_pulls.labels(result)
        if read_live is not None:
            r.register(_LiveValues(read_live))

    def export_routes(self, routes: Iterable[tuple[str, Iterable[str], int]]) -> None:
        """Export each route's requests at 0 from the start, as (path, methods, the status it answers when it
        serves): a route's first burst is seen by rate() as the counters by API's are. The status of a refusal is
        not known in advance, and appears with the first."""
        for path, methods, status in routes:
            self.request_seconds.labels(path)
            for method in methods:
                self.requests.labels(path, method, str(status))

    def observe_request(self, path: str, method: str, status: int, seconds: float) -> None:
        """Count an HTTP request and time it, by route path."""
        self.requests.labels(path, method, str(status)).inc()
        self.request_seconds.labels(path).observe(seconds)

    def observe_retrain(self, result: dict[str, Any]) -> None:
        """A learner's retrain result: {"ttft": {"accepted_mean", "accepted_upper", ...}, "duration_s": s}."""
        self.retrain_seconds.observe(float(result.get("duration_s", 0.0)))
        for target in ("ttft", "tpot"):
            outcome = result.get(target)
            if not isinstance(outcome, dict):
                continue
            accepted = bool(outcome.get("accepted") or outcome.get("accepted_mean") or outcome.get("accepted_upper"))
            self.retrains.labels(target, "accepted" if accepted else "rejected").inc()

    def observe_retrain_failure(self, count: int = 1) -> None:
        """Count retrains that failed, for both targets (a retrain fits both)."""
        for target in ("ttft", "tpot"):
            self.retrains.labels(target, "failed").inc(count)

    def observe_live_error(
        self,
        target: str,
        actual: np.ndarray,
        predicted_mean: np.ndarray,
        predicted_quantile: np.ndarray,
        accelerators: Iterable[str],
        roles: Iterable[str],
    ) -> None:
        """Per decision: absolute percentage error of the mean and coverage of the quantile, where known."""
        for a, m, q, acc, role in zip(actual, predicted_mean, predicted_quantile, accelerators, roles, strict=True):
            if not a > 0:
                continue
            if m == m:  # not NaN
                self.live_error.labels(target, acc, role).observe(abs(float(m) - float(a)) / float(a))
            if q == q:
                covered = a <= q
                self.quantile_checks.labels(target, acc, role, "true" if covered else "false").inc()
                if (target, acc, role) not in self._coverage_keys:  # both series from the first check: coverage 0
                    self._coverage_keys.add((target, acc, role))  # reads 0, not "no data"
                    self.quantile_checks.labels(target, acc, role, "false" if covered else "true")

    def render(self, llmd_lines: dict[str, Any] | None = None) -> bytes:
        """Prometheus text; with `llmd_lines`, also the llm-d training-server lines its tooling greps."""
        text = generate_latest(self.registry)
        if llmd_lines is None:
            return text
        return text + llmd_training_lines(**llmd_lines).encode()


LLMD_LINE_HELP = {
    "model_type": "llm-d: the kind of model serving (its type label), always 1.",
    "objective_type": "llm-d: what the served predictions estimate (its type label: quantile or mean), always 1.",
    "model_quantile": "llm-d: the upper quantile predicted (0.9 = p90).",
    "ensemble_active": "llm-d: 1 while an ensemble of models serves; Leadtime serves none (0).",
    "ensemble_mode": "llm-d: 1 in ensemble mode; Leadtime has none (0).",
    "training_samples_count": "llm-d: accepted training samples per target model (test samples held out excluded).",
    "ttft_intercept": "llm-d: the TTFT model's intercept; tree models have none (0).",
    "ttft_importance": "llm-d: each llm-d input's share of the TTFT trees' gain (0 before the first tree).",
    "tpot_intercept": "llm-d: the TPOT model's intercept; tree models have none (0).",
    "tpot_importance": "llm-d: each llm-d input's share of the TPOT trees' gain (0 before the first tree).",
}
"""HELP text of llm-d's training-server lines: promtool and Prometheus tooling want every family described, and
comment lines change nothing llm-d's greps and dashboards match (names, labels and values stay its own)."""


def llmd_training_lines(
    objective: str,
    quantile: float,
    samples: dict[str, int],
    importances: dict[str, dict[str, float]] | None = None,
) -> str:
    """llm-d's non-standard training-server lines, exactly in its shape, each family headed by HELP and TYPE
    lines (`LLMD_LINE_HELP`). `importances`: per target, llm-d input → share of the trees' gain (missing or
    empty: zeros, as llm-d shows before its first model). The intercept lines are 0.0: llm-d's tree models report
    none, and neither do Leadtime's."""
    from leadtime.features.rows import LLMD_MODEL_INPUTS

    lines: list[str] = []

    def family(name: str, *samples: str) -> None:
        lines.extend((f"# HELP {name} {LLMD_LINE_HELP[name]}", f"# TYPE {name} gauge", *samples))

    family("model_type", 'model_type{type="lightgbm"} 1')
    family("objective_type", f'objective_type{{type="{objective}"}} 1')
    family("model_quantile", f"model_quantile{{}} {quantile:g}")
    family("ensemble_active", "ensemble_active{} 0")
    family("ensemble_mode", "ensemble_mode{} 0")
    family(
        "training_samples_count",
        *(f'training_samples_count{{model="{target}"}} {samples.get(target, 0)}' for target in ("ttft", "tpot")),
    )
    for target in ("ttft", "tpot"):
        shares = (importances or {}).get(target) or {}
        family(f"{target}_intercept", f"{target}_intercept{{}} 0.0")
        family(
            f"{target}_importance",
            *(
                f'{target}_importance{{feature="{name}"}} {float(shares.get(name, 0.0))!r}'
                for name in LLMD_MODEL_INPUTS
            ),
        )
    return "\n".join(lines) + "\n"
