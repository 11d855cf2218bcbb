"""The gateway's Prometheus metrics (`leadtime_router_*`), in a registry of its own.

What a dashboard needs to see the router work: picks per endpoint and accelerator class, P/D decisions,
time-slice filtering, fallbacks to the heuristics and why, the predictor's call latency, predicted next to actual
TTFT and ITL of routed requests, SLO attainment, the gateway's own added time, retries and upstream errors, the
scrapes and the observations sent back to the predictor.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from leadtime.predictor.model_pull import PULL_RESULTS
from leadtime.router_plugin.config import DEFAULT_DEADLINE_MS

# TTFT (and time held): at most 1.5x apart from 10 ms to 2 s, where routed requests' TTFTs fall, so that a median
# interpolated inside one bucket moves with the TTFT rather than sitting on a bucket's midpoint.
LATENCY_BUCKETS_S = (
    *(0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0),
)
# Mean ITL: at most a third apart from 2 to 20 ms (8B models on H100/H200 decode at 5-10 ms a token), so that a 2x
# change in decode speed moves the median panel.
ITL_BUCKETS_S = (
    *(0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.012, 0.014, 0.016, 0.018, 0.02),
    *(0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0),
)
# Predictor calls, decisions and overhead. A predict call that runs into its deadline (fallback.deadlineMs, 20 ms by
# default) lasts just over it: a bucket a quarter above the default keeps such calls from reading as 50 ms at the
# p99. Up to 10 s: an observe call that runs into its own deadline (2 s) must not read as 1 s.
FAST_BUCKETS_S = tuple(
    sorted(
        {0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 2.5, 5.0, 10.0}
        | {round(1.25 * DEFAULT_DEADLINE_MS / 1e3, 6)}
    )
)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0, 16.0)
# Label values exported at 0 from the start, so a dashboard shows "none" rather than no data: why a decision fell
# back (predictor.failure_reason's labels, and a policy that raised), SLO results, what became of observations,
# what pulls of the service's model did (so that an alert on the rate of failing pulls has a series before the first).
FALLBACK_REASONS = ("deadline", "unavailable", "circuit_open", "refused", "invalid_answer", "policy_error", "queued")
SLO_TARGETS = ("ttft", "itl", "both")
SLO_RESULTS = ("met", "missed")
OBSERVATION_RESULTS = ("queued", "sent", "failed", "dropped")
REPLICA_EVENT_DIRECTIONS = ("sent", "received", "dropped", "refused", "missed")
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
"""The `status` label of upstream_responses: an endpoint's answers by class, not by code (fewer series)."""
DISCOVERY_RESULTS = ("ok", "error")
"""What one reload of the discovery file did: its endpoints taken, or the file refused (the last ones kept)."""


class GatewayMetrics:
    """Every metric the gateway exports; `render()` is the body of its `/metrics`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "leadtime_router"
        self.requests = Counter(
            f"{p}_requests", "Requests answered, by path and status code.", ["path", "code"], registry=r
        )
        self.picks = Counter(
            f"{p}_picks",
            "Requests routed to each endpoint, by endpoint, accelerator class and role; on P/D a request counts "
            "on its prefill endpoint and on its decode endpoint (once when its decode endpoint prefills it).",
            ["endpoint", "accelerator", "role"],
            registry=r,
        )
        self.pd_decisions = Counter(
            f"{p}_pd_decisions",
            "Decisions on a P/D fleet: disaggregated or prefilled locally.",
            ["decision"],
            registry=r,
        )
        self.timeslice_filtered = Counter(
            f"{p}_timeslice_filtered", "Candidates left out because their time-slice group was not serving.", registry=r
        )
        self.fallbacks = Counter(
            f"{p}_fallbacks",
            "Decisions made by the heuristic fallback, by the predictor's failure.",
            ["reason"],
            registry=r,
        )
        self.predictor_seconds = Histogram(
            f"{p}_predictor_call_seconds",
            "Predictor calls, by kind and result.",
            ["call", "result"],
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        self.decision_seconds = Histogram(
            f"{p}_decision_seconds",
            "Time to decide where a request goes (predictor call included).",
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        self.overhead_seconds = Histogram(
            f"{p}_overhead_seconds",
            "Time the gateway adds before it forwards a request (parse, decide; the client's upload of its body, time "
            "held for an SLO, the wait on an endpoint that failed it first, connecting and sending are not in it).",
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            f"{p}_ttft_seconds",
            "TTFT of routed requests measured (streaming ones, and non-streaming ones sent on as streams), from when "
            "each was sent to its endpoint, predicted and actual.",
            ["kind", "accelerator"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl_seconds = Histogram(
            f"{p}_itl_seconds",
            "Mean ITL of routed requests measured (streaming ones, and non-streaming ones sent on as streams), "
            "predicted and actual.",
            ["kind", "accelerator"],
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.ttft_ratio = Histogram(
            f"{p}_ttft_actual_over_predicted",
            "Actual TTFT ÷ predicted TTFT of routed requests.",
            ["accelerator"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.itl_ratio = Histogram(
            f"{p}_itl_actual_over_predicted",
            "Actual ITL ÷ predicted ITL of routed requests.",
            ["accelerator"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            f"{p}_slo",
            "Requests measured (streaming, and non-streaming sent on as streams) against their SLOs, by target and "
            "result, TTFT as its client waited for it (from its body's arrival, through any hold and retry); requests "
            "that failed are not in it (see requests_total by code).",
            ["target", "result"],
            registry=r,
        )
        self.held_seconds = Histogram(
            f"{p}_held_seconds",
            "Time requests waited at the router because no endpoint was predicted to serve them in time (held).",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            f"{p}_retries",
            "Requests sent to a second endpoint after the first failed before responding, or answered 502, 503 or 504.",
            registry=r,
        )
        self.upstream_errors = Counter(
            f"{p}_upstream_errors",
            "Failures to reach an endpoint or read its answer, by endpoint and kind.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.upstream_responses = Counter(
            f"{p}_upstream_responses",
            "Answers of endpoints to requests sent on, by endpoint and status class (2xx, 3xx, 4xx, 5xx): which "
            "endpoint answers errors, which the gateway's own requests_total (by path) cannot say.",
            ["endpoint", "status"],
            registry=r,
        )
        self.explorations = Counter(
            f"{p}_explorations",
            "Decisions that took an endpoint the model is unsure of (the exploration share), not the best predicted "
            "one: they keep every endpoint observed, at a small cost in latency.",
            registry=r,
        )
        self.ejections = Counter(
            f"{p}_endpoint_ejections",
            "Times an endpoint was taken out of routing for failing the requests sent to it (outliers.py).",
            ["endpoint"],
            registry=r,
        )
        self.non_streaming = Counter(
            f"{p}_non_streaming",
            "Non-streaming requests, by whether they were sent on as streams, to be measured, or unchanged, to be "
            "answered whole.",
            ["measured"],
            registry=r,
        )
        self.inflight = Gauge(f"{p}_inflight_requests", "Requests being proxied now.", registry=r)
        self.endpoints = Gauge(
            f"{p}_endpoints", "Discovered endpoints, by whether they can be routed to.", ["routable"], registry=r
        )
        self.endpoint_up = Gauge(
            f"{p}_endpoint_routable", "1 when the endpoint can be routed to.", ["endpoint"], registry=r
        )
        self.scrape_age = Gauge(
            f"{p}_scrape_age_seconds", "Age of each endpoint's last good scrape.", ["endpoint"], registry=r
        )
        self.scrape_errors = Counter(
            f"{p}_scrape_errors", "Failed /metrics scrapes, by endpoint.", ["endpoint"], registry=r
        )
        self.scrape_seconds = Histogram(
            f"{p}_scrape_seconds", "Duration of /metrics scrapes.", buckets=FAST_BUCKETS_S, registry=r
        )
        self.discovery_reloads = Counter(
            f"{p}_discovery_reloads", "Discovery file reloads, by result.", ["result"], registry=r
        )
        self.observations_waiting = Gauge(
            f"{p}_observations_waiting",
            "Observations queued for the predictor now, not yet sent (each retried until sent or dropped): what to "
            'alert on, where observations_total{result="failed"} counts every attempt.',
            registry=r,
        )
        self.observations = Counter(
            f"{p}_observations",
            "Observations for the predictor: queued, sent, dropped (the queue full, still queued at a stop, or "
            "refused by the predictor for good); "
            "failed counts each failed attempt to send one (it stays queued and is sent again: not a loss).",
            ["result"],
            registry=r,
        )
        self.prefix_estimated = Counter(
            f"{p}_prefix_hit_tokens_estimated",
            "Prompt tokens estimated cached where each request was sent.",
            ["endpoint"],
            registry=r,
        )
        self.prefix_reported = Gauge(
            f"{p}_endpoint_prefix_cache_hit_tokens",
            "The endpoint's own count of prefix-cache hit tokens (as scraped).",
            ["endpoint"],
            registry=r,
        )
        self.bytes_per_token = Gauge(
            f"{p}_prompt_bytes_per_token", "Learned bytes of prompt text per token.", registry=r
        )
        self.model_pulls = Counter(
            f"{p}_model_pulls",
            f"Pulls of the service's model (--pull-model), by result: {', '.join(PULL_RESULTS)}.",
            ["result"],
            registry=r,
        )
        self.pulled_model_age = Gauge(
            f"{p}_pulled_model_age_seconds",
            "Seconds since a pull of the service's model last reached it (--pull-model; -1 before any did).",
            registry=r,
        )
        self.pulled_model_age.set(-1.0)
        self.timeslice_group_serving = Gauge(
            f"{p}_timeslice_group_serving",
            "Whether the router takes a time-slice group as serving the inference job (1) or away (0), by group; "
            "a group the states do not name counts as serving.",
            ["group"],
            registry=r,
        )
        self.timeslice_states_age = Gauge(
            f"{p}_timeslice_states_age_seconds",
            "Seconds since the time-slice states routed on were last read or found unchanged (none read yet: since "
            "the gateway started watching them).",
            registry=r,
        )
        self.timeslice_source_errors = Counter(
            f"{p}_timeslice_source_errors", "Failed reads of time-slice group states.", registry=r
        )
        self.replica_events = Counter(
            f"{p}_replica_events",
            "Ledger changes shared with the other gateway replicas (--replicas-redis): sent, received, dropped "
            "(not published: Redis away or the queue full), refused (a message that was not a replica's), missed "
            "(another replica's requests whose completion this one did not hear, let go of when that replica's "
            "heartbeat no longer listed them).",
            ["direction"],
            registry=r,
        )
        self.replicas_heard = Gauge(
            f"{p}_replicas_heard", "Other gateway replicas heard within the last few seconds.", registry=r
        )
        self.replica_requests = Gauge(
            f"{p}_replica_requests_in_flight",
            "Requests the other gateway replicas have in flight, as this one knows them.",
            registry=r,
        )

        for direction in REPLICA_EVENT_DIRECTIONS:
            self.replica_events.labels(direction)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for target in SLO_TARGETS:
            for result in SLO_RESULTS:
                self.slo.labels(target, result)
        for result in OBSERVATION_RESULTS:
            self.observations.labels(result)
        for result in PULL_RESULTS:
            self.model_pulls.labels(result)
        for result in DISCOVERY_RESULTS:
            self.discovery_reloads.labels(result)
        for measured in ("true", "false"):
            self.non_streaming.labels(measured)

    def render(self) -> bytes:
        return generate_latest(self.registry)
