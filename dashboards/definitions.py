"""The two dashboards, panel by panel: the one source the JSON files in this folder are written from.

`leadtime-predictor` watches the service (`leadtime serve`, metrics `leadtime_*` from `predictor/metrics.py`);
`leadtime-router` watches the gateway (`leadtime route`, `leadtime_router_*` from
`router_plugin/gateway/metrics.py`). Every expression filters by the `instance` variable (replicas) and, where
the metric has the label, by accelerator class, role or endpoint. Rates use Grafana's `$__rate_interval` (at
least four scrape intervals, so set the data source's scrape interval); rare events (retrains) use fixed
30-minute windows. Counters are exported at 0 for every label value known in advance (APIs, gRPC methods, retrain
outcomes, fallback reasons, SLO results, observation results, and each discovered endpoint's errors, answers and
ejections), since `rate()` and `increase()` never count a series' first value: no query needs `... or vector(0)`,
which beside a `sum by` would add a series with no labels.

>>> [d.uid for d in DASHBOARDS]
['leadtime-predictor', 'leadtime-router']
>>> all(p.description and p.unit for d in DASHBOARDS for p in d.panels())
True
"""

from __future__ import annotations

from leadtime.dashboards.grafana import Dashboard, Panel, Query, Row, Variable
from leadtime.predictor.metrics import GRPC_CLIENT_STREAMS

RATE = "[$__rate_interval]"
RARE = "[30m]"  # retrains are minutes apart: a window that holds some
INSTANCE = 'instance=~"$instance"'
NOT_SCRAPES = f'{INSTANCE}, path!="/metrics"'  # the service's API routes, Prometheus's scrapes left out
NOT_STREAMS = f'{INSTANCE}, method!~"{"|".join(GRPC_CLIENT_STREAMS)}"'  # calls, not streams open for minutes
LIVE = 'instance=~"$instance", accelerator=~"$accelerator", role=~"$role"'
APE = "leadtime_live_absolute_percentage_error_ratio"
CHECKS = "leadtime_live_quantile_checks_total"
UP_DOWN = ((0, "down", "red"), (1, "up", "green"))


def _ratio(numerator: str, denominator: str, by: str) -> str:
    """sum by (`by`) (rate(numerator)) / sum by (`by`) (rate(denominator)), both over the rate interval."""
    return f"sum by ({by}) (rate({numerator}{RATE}))\n/\nsum by ({by}) (rate({denominator}{RATE}))"


def _quantile(q: float, histogram: str, selector: str, by: str, window: str = RATE) -> str:
    """The `q` quantile of a histogram's observations in each window, per `by` group."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{{{selector}}}{window})))"


PREDICTOR = Dashboard(
    uid="leadtime-predictor",
    title="Leadtime predictor",
    description="The latency predictor service (leadtime serve): live prediction error and p90 coverage per target, "
    "accelerator class and role; traffic; API latency; the model, its retrains; lost observations; the store.",
    variables=(
        Variable("instance", "Replica", "leadtime_model_version"),
        Variable("accelerator", "Accelerator class", f"{APE}_count"),
        Variable("role", "Role", f"{APE}_count"),
    ),
    rows=(
        Row(
            "Prediction error (observed decisions)",
            (
                Panel(
                    "Mean absolute percentage error by target",
                    "MAPE of the mean prediction over the decisions observed in each interval: |predicted − actual| "
                    "÷ actual, averaged. Measured on observations that carry what was predicted (the gateway's, "
                    "or any client of /v1/observations and gRPC Observe); llm-d's training posts carry none.",
                    "percentunit",
                    (Query(_ratio(f"{APE}_sum{{{LIVE}}}", f"{APE}_count{{{LIVE}}}", "target"), "{{target}}"),),
                    min=0,
                    main=True,
                ),
                Panel(
                    "Absolute percentage error quantiles",
                    "Median and 90th percentile of the absolute percentage error per target, from the histogram "
                    "leadtime_live_absolute_percentage_error_ratio (buckets from 1% to 500%).",
                    "percentunit",
                    (
                        Query(_quantile(0.5, APE, LIVE, "target"), "{{target}} p50"),
                        Query(_quantile(0.9, APE, LIVE, "target"), "{{target}} p90"),
                    ),
                    min=0,
                    main=True,
                ),
                Panel(
                    "MAPE by accelerator class and role",
                    "The same error per target, accelerator class and role: a class or a P/D role the model gets "
                    "wrong stands out here before it moves the fleet-wide figure.",
                    "percentunit",
                    (
                        Query(
                            _ratio(f"{APE}_sum{{{LIVE}}}", f"{APE}_count{{{LIVE}}}", "target, accelerator, role"),
                            "{{target}} {{accelerator}} {{role}}",
                        ),
                    ),
                    min=0,
                ),
                Panel(
                    "Upper-quantile coverage against its target",
                    "Share of observed decisions whose actual was at or below the predicted upper quantile (p90 "
                    "by default), per target; the dashed line is the quantile the service predicts "
                    "(leadtime_model_quantile). Calibrated, coverage sits on the line.",
                    "percentunit",
                    (
                        Query(
                            _ratio(f'{CHECKS}{{{LIVE}, covered="true"}}', f"{CHECKS}{{{LIVE}}}", "target"), "{{target}}"
                        ),
                        Query(f"max(leadtime_model_quantile{{{INSTANCE}}})", "target quantile"),
                    ),
                    min=0,
                    max=1,
                    dashed=("target quantile",),
                    main=True,
                ),
                Panel(
                    "Coverage by accelerator class and role",
                    "Upper-quantile coverage per target, accelerator class and role.",
                    "percentunit",
                    (
                        Query(
                            _ratio(
                                f'{CHECKS}{{{LIVE}, covered="true"}}',
                                f"{CHECKS}{{{LIVE}}}",
                                "target, accelerator, role",
                            ),
                            "{{target}} {{accelerator}} {{role}}",
                        ),
                    ),
                    min=0,
                    max=1,
                ),
                Panel(
                    "Observed decisions per second by class and role",
                    "How many observations with predictions each error figure above rests on.",
                    "ops",
                    (
                        Query(
                            f"sum by (target, accelerator, role) (rate({APE}_count{{{LIVE}}}{RATE}))",
                            "{{target}} {{accelerator}} {{role}}",
                        ),
                    ),
                    width=12,
                    min=0,
                ),
            ),
        ),
        Row(
            "Traffic",
            (
                Panel(
                    "Predictions per second by API",
                    "Rows predicted per second: llmd (llm-d's paths), native (/v1/predict), grpc.",
                    "ops",
                    (Query(f"sum by (api) (rate(leadtime_predictions_total{{{INSTANCE}}}{RATE}))", "{{api}}"),),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Observations per second",
                    "Observations accepted per API, rejected as invalid, and learned by the learner process. "
                    "Learned trails accepted under load; see the backlog. After a restart, learned also takes the "
                    "rows replayed: an earlier process accepted them, this one reads them back from the shared "
                    "stream to learn them.",
                    "ops",
                    (
                        Query(
                            f"sum by (api) (rate(leadtime_observations_accepted_total{{{INSTANCE}}}{RATE}))",
                            "accepted {{api}}",
                        ),
                        Query(f"sum(rate(leadtime_observations_replayed_total{{{INSTANCE}}}{RATE}))", "replayed"),
                        Query(f"sum(rate(leadtime_observations_learned_total{{{INSTANCE}}}{RATE}))", "learned"),
                        Query(
                            f"sum(rate(leadtime_observations_rejected_total{{{INSTANCE}}}{RATE}))",
                            "rejected",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Backlog: observations waiting to be learned",
                    "Accepted observations the learner has not taken yet. Up to 50,000 are kept in full; beyond "
                    "that the in-memory store thins them evenly over time (see Lost observations).",
                    "short",
                    (Query(f"sum by (instance) (leadtime_observations_pending{{{INSTANCE}}})", "{{instance}}"),),
                    width=8,
                    min=0,
                ),
            ),
        ),
        Row(
            "API latency",
            (
                Panel(
                    "HTTP latency by path (p50, p99)",
                    "Time to answer an HTTP request, per route, inside the service (from the first byte read to the "
                    "answer written). Prometheus's scrapes of /metrics are left out: slower than the API's calls, "
                    "they set the scale and hid the hot paths.",
                    "s",
                    (
                        Query(
                            _quantile(0.5, "leadtime_http_request_duration_seconds", NOT_SCRAPES, "path"),
                            "{{path}} p50",
                        ),
                        Query(
                            _quantile(0.99, "leadtime_http_request_duration_seconds", NOT_SCRAPES, "path"),
                            "{{path}} p99",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "gRPC latency by method (p50, p99)",
                    "Time to answer a gRPC call (leadtime.v1.Predictor), per method. ObserveStream is left out: it "
                    "is timed for the stream's whole life, as long as its client keeps sending batches, which would "
                    "set the scale and say nothing of how fast the service answers.",
                    "s",
                    (
                        Query(
                            _quantile(0.5, "leadtime_grpc_request_duration_seconds", NOT_STREAMS, "method"),
                            "{{method}} p50",
                        ),
                        Query(
                            _quantile(0.99, "leadtime_grpc_request_duration_seconds", NOT_STREAMS, "method"),
                            "{{method}} p99",
                        ),
                    ),
                    width=8,
                    min=0,
                ),
                Panel(
                    "Requests per second by path and status",
                    "HTTP requests per route and status code, and gRPC calls per method and code (those with calls).",
                    "reqps",
                    (
                        Query(
                            f"sum by (path, status) (rate(leadtime_http_requests_total{{{INSTANCE}}}{RATE}))",
                            "{{path}} {{status}}",
                        ),
                        Query(
                            # > 0: every method's every status code is exported from the start (68 series at 0)
                            f"sum by (method, code) (rate(leadtime_grpc_requests_total{{{INSTANCE}}}{RATE})) > 0",
                            "gRPC {{method}} {{code}}",
                        ),
                    ),
                    width=8,
                    min=0,
                ),
            ),
        ),
        Row(
            "Model",
            (
                Panel(
                    "Model version",
                    "Version of the model each replica serves; replicas sharing Redis converge on the newest "
                    "published one within a second.",
                    "none",
                    (Query(f"max by (instance) (leadtime_model_version{{{INSTANCE}}})", "{{instance}}"),),
                    kind="stat",
                    width=6,
                ),
                Panel(
                    "Model age",
                    "Seconds since the serving model last changed (a retrain accepted, trees installed by the "
                    "retraining job), as its artifact records: a restart does not reset it; since start-up if it "
                    "never has.",
                    "s",
                    (Query(f"max by (instance) (leadtime_model_age_seconds{{{INSTANCE}}})", "{{instance}}"),),
                    kind="stat",
                    width=6,
                ),
                Panel(
                    "Retrain outcomes",
                    "Retrains per target and outcome in each interval: accepted (the new trees beat the serving "
                    "model on held-out data and replaced it), rejected, failed.",
                    "short",
                    (
                        Query(
                            f"sum by (target, outcome) (increase(leadtime_retrains_total{{{INSTANCE}}}{RATE}))",
                            "{{target}} {{outcome}}",
                        ),
                    ),
                    kind="bars",
                    width=12,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Retrain duration (last 30 min)",
                    "Mean and 90th percentile wall time of a retrain of both targets, over the last 30 minutes.",
                    "s",
                    (
                        Query(
                            f"sum(increase(leadtime_retrain_duration_seconds_sum{{{INSTANCE}}}{RARE}))\n/\n"
                            f"sum(increase(leadtime_retrain_duration_seconds_count{{{INSTANCE}}}{RARE}))",
                            "mean",
                        ),
                        Query(_quantile(0.9, "leadtime_retrain_duration_seconds", INSTANCE, "", RARE), "p90"),
                    ),
                    width=8,
                    min=0,
                ),
                Panel(
                    "Observations learned and training window",
                    "Observations the serving model has learned from per target (a gauge: adopting another "
                    "replica's model changes it), and the samples in the retraining window.",
                    "short",
                    (
                        Query(f"max by (target) (leadtime_model_observations{{{INSTANCE}}})", "learned {{target}}"),
                        Query(f"max by (target) (leadtime_window_samples{{{INSTANCE}}})", "window {{target}}"),
                    ),
                    width=8,
                    min=0,
                ),
                Panel(
                    "Models swapped in",
                    "Models adopted from the shared registry or a reload, per interval.",
                    "short",
                    (Query(f"sum(increase(leadtime_model_swaps_total{{{INSTANCE}}}{RATE}))", "swaps"),),
                    kind="bars",
                    width=8,
                    min=0,
                ),
            ),
        ),
        Row(
            "Lost observations and the store",
            (
                Panel(
                    "Lost observations",
                    "Accepted observations that will not be learned, per reason and interval (backlog_full, "
                    "store_bound, store_buffer: Redis was away longer than the buffer holds, invalid, implausible: "
                    "the poisoning guard, flushed: still waiting to be learned when /flush was called), and those "
                    "thinned to keep up with overload (evenly over time).",
                    "short",
                    (
                        Query(
                            f"sum by (reason) (increase(leadtime_observations_lost_total{{{INSTANCE}}}{RATE}))",
                            "lost {{reason}}",
                        ),
                        Query(
                            f"sum by (reason) (increase(leadtime_observations_thinned_total{{{INSTANCE}}}{RATE}))",
                            "thinned {{reason}}",
                        ),
                    ),
                    kind="bars",
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Redis health",
                    "leadtime_store_up: 1 while Redis answers (component redis), 0 while it does not; replicas "
                    "keep serving with their last model meanwhile. The in-memory store shows as component store.",
                    "none",
                    (Query(f"leadtime_store_up{{{INSTANCE}}}", "{{instance}} {{component}}"),),
                    kind="state",
                    width=8,
                    states=UP_DOWN,
                ),
                Panel(
                    "Buffered while Redis is away, and thinning",
                    "Observations waiting in memory for Redis to come back (up to 100,000 per replica), and the "
                    "thinning stride (1 = every accepted row is learned, n = one in n).",
                    "short",
                    (
                        Query(
                            f"sum by (instance) (leadtime_observations_buffered{{{INSTANCE}}})", "buffered {{instance}}"
                        ),
                        Query(
                            f"max by (instance) (leadtime_ingestion_learning_one_in{{{INSTANCE}}})",
                            "learning 1 in n {{instance}}",
                        ),
                    ),
                    width=8,
                    min=0,
                ),
            ),
        ),
    ),
)


ROUTER_INSTANCE = 'instance=~"$instance"'
PICKS = 'instance=~"$instance", endpoint=~"$endpoint", accelerator=~"$accelerator"'
BY_CLASS = 'instance=~"$instance", accelerator=~"$accelerator"'

ROUTER = Dashboard(
    uid="leadtime-router",
    title="Leadtime router",
    description="The routing gateway (leadtime route): where requests go, fallbacks to the heuristics, predicted "
    "against actual TTFT and ITL of routed requests, SLO attainment, P/D decisions and time-slice filtering.",
    variables=(
        Variable("instance", "Gateway", "leadtime_router_endpoints"),
        Variable("accelerator", "Accelerator class", "leadtime_router_picks_total"),
        Variable("endpoint", "Endpoint", "leadtime_router_picks_total"),
    ),
    rows=(
        Row(
            "Routing decisions",
            (
                Panel(
                    "Picks per second by endpoint",
                    "Routing decisions per endpoint (a P/D pair counts once for its prefill and once for its "
                    "decode endpoint), with the endpoint's role.",
                    "ops",
                    (
                        Query(
                            f"sum by (endpoint, role) (rate(leadtime_router_picks_total{{{PICKS}}}{RATE}))",
                            "{{endpoint}} ({{role}})",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Picks per second by accelerator class",
                    "The same decisions per accelerator class and role: how the router spreads work over the "
                    "hardware generations of the fleet.",
                    "ops",
                    (
                        Query(
                            f"sum by (accelerator, role) (rate(leadtime_router_picks_total{{{PICKS}}}{RATE}))",
                            "{{accelerator}} ({{role}})",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Fallbacks to the heuristics",
                    "Decisions made by the heuristic scorers because the predictor missed its deadline, was "
                    "unavailable, rested after failures (circuit_open), refused the rows, could not keep up with the "
                    "decisions (queued), or the policy failed; as a share of all decisions.",
                    "percentunit",
                    (
                        Query(
                            f"sum by (reason) (rate(leadtime_router_fallbacks_total{{{ROUTER_INSTANCE}}}{RATE}))\n/ "
                            f"ignoring (reason) group_left\n"
                            f"sum(rate(leadtime_router_decision_seconds_count{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{reason}}",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Decision time and predictor calls (p50, p99)",
                    "Time to decide where a request goes (predictor call included), and the predictor calls by "
                    "kind (predict, observe) and result.",
                    "s",
                    (
                        Query(_quantile(0.5, "leadtime_router_decision_seconds", ROUTER_INSTANCE, ""), "decision p50"),
                        Query(_quantile(0.99, "leadtime_router_decision_seconds", ROUTER_INSTANCE, ""), "decision p99"),
                        Query(
                            _quantile(0.99, "leadtime_router_predictor_call_seconds", ROUTER_INSTANCE, "call, result"),
                            "{{call}} {{result}} p99",
                        ),
                    ),
                    width=12,
                    min=0,
                ),
                Panel(
                    "Time the gateway adds (p50, p99)",
                    "From a request's arrival (its body read) to its forwarding to the endpoint: parsing it and "
                    "deciding (time held for an SLO, and the wait on an endpoint that failed it first, excluded); "
                    "connecting to the endpoint and sending show in TTFT.",
                    "s",
                    (
                        Query(_quantile(0.5, "leadtime_router_overhead_seconds", ROUTER_INSTANCE, ""), "p50"),
                        Query(_quantile(0.99, "leadtime_router_overhead_seconds", ROUTER_INSTANCE, ""), "p99"),
                    ),
                    width=12,
                    min=0,
                ),
            ),
        ),
        Row(
            "Predicted against actual",
            (
                Panel(
                    "TTFT of routed requests: predicted and actual (median)",
                    "Median time to first token of routed streaming requests per accelerator class (of the "
                    "prefill endpoint): what the router predicted when it chose, and what the stream showed.",
                    "s",
                    (
                        Query(
                            _quantile(0.5, "leadtime_router_ttft_seconds", BY_CLASS, "kind, accelerator"),
                            "{{accelerator}} {{kind}}",
                        ),
                    ),
                    min=0,
                    main=True,
                ),
                Panel(
                    "ITL of routed requests: predicted and actual (mean, median)",
                    "Mean inter-token latency of routed streaming requests per accelerator class (of the decode "
                    "endpoint), predicted and actual: averaged over the requests (exact, from the histogram's sum "
                    "and count), and their median (interpolated within a histogram bucket, 1 ms wide around 5-10 ms).",
                    "s",
                    (
                        Query(
                            _ratio(
                                f"leadtime_router_itl_seconds_sum{{{BY_CLASS}}}",
                                f"leadtime_router_itl_seconds_count{{{BY_CLASS}}}",
                                "kind, accelerator",
                            ),
                            "{{accelerator}} {{kind}} mean",
                        ),
                        Query(
                            _quantile(0.5, "leadtime_router_itl_seconds", BY_CLASS, "kind, accelerator"),
                            "{{accelerator}} {{kind}} median",
                        ),
                    ),
                    min=0,
                    main=True,
                ),
                Panel(
                    "Actual ÷ predicted TTFT (median, p90)",
                    "Per accelerator class, actual TTFT divided by the predicted mean: 1 is exact, above 1 the "
                    "router was optimistic.",
                    "none",
                    (
                        Query(
                            _quantile(0.5, "leadtime_router_ttft_actual_over_predicted", BY_CLASS, "accelerator"),
                            "{{accelerator}} p50",
                        ),
                        Query(
                            _quantile(0.9, "leadtime_router_ttft_actual_over_predicted", BY_CLASS, "accelerator"),
                            "{{accelerator}} p90",
                        ),
                    ),
                    min=0,
                ),
                Panel(
                    "Actual ÷ predicted ITL (median, p90)",
                    "Per accelerator class, actual mean ITL divided by the predicted mean.",
                    "none",
                    (
                        Query(
                            _quantile(0.5, "leadtime_router_itl_actual_over_predicted", BY_CLASS, "accelerator"),
                            "{{accelerator}} p50",
                        ),
                        Query(
                            _quantile(0.9, "leadtime_router_itl_actual_over_predicted", BY_CLASS, "accelerator"),
                            "{{accelerator}} p90",
                        ),
                    ),
                    min=0,
                ),
            ),
        ),
        Row(
            "SLOs and traffic",
            (
                Panel(
                    "SLO attainment",
                    "Share of streaming requests with SLOs (x-llm-d-slo-ttft-ms / x-llm-d-slo-tpot-ms headers, or "
                    "the gateway's defaults) that met their TTFT SLO, their ITL SLO, and both; TTFT as the client "
                    "waited for it (a hold and a retry included). Only completed requests count: one that failed at "
                    "its endpoint is in neither share (see the endpoint errors).",
                    "percentunit",
                    (
                        Query(
                            _ratio(
                                f'leadtime_router_slo_total{{{ROUTER_INSTANCE}, result="met"}}',
                                f"leadtime_router_slo_total{{{ROUTER_INSTANCE}}}",
                                "target",
                            ),
                            "{{target}}",
                        ),
                    ),
                    width=6,
                    min=0,
                    max=1,
                    main=True,
                ),
                Panel(
                    "Requests per second by status",
                    "Requests the gateway answered per path and status code (unmatched: no route, 404), those it "
                    "held while no endpoint was predicted to serve them in time (with holdSloMultiple), and the "
                    "non-streaming ones: measured (sent on as streams and learned from) or answered whole.",
                    "reqps",
                    (
                        Query(
                            f"sum by (path, code) (rate(leadtime_router_requests_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{path}} {{code}}",
                        ),
                        Query(f"sum(rate(leadtime_router_held_seconds_count{{{ROUTER_INSTANCE}}}{RATE}))", "held"),
                        Query(
                            f"sum by (measured) (rate(leadtime_router_non_streaming_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "non-streaming, measured={{measured}}",
                        ),
                    ),
                    width=6,
                    min=0,
                ),
                Panel(
                    "Requests in flight",
                    "Requests each gateway proxies or passes through now.",
                    "short",
                    (
                        Query(
                            f"sum by (instance) (leadtime_router_inflight_requests{{{ROUTER_INSTANCE}}})",
                            "{{instance}}",
                        ),
                    ),
                    width=6,
                    min=0,
                ),
                Panel(
                    "Retries, endpoint failures and ejections",
                    "Requests sent to a second endpoint after the first failed before answering or answered 502-504; "
                    "per endpoint, failures to reach it or read its answer by kind, its 5xx answers, and the times "
                    "it was taken out of routing for failing (0 when none has failed).",
                    "reqps",
                    (
                        Query(f"sum(rate(leadtime_router_retries_total{{{ROUTER_INSTANCE}}}{RATE}))", "retries"),
                        Query(
                            "sum by (endpoint, kind) "
                            f"(rate(leadtime_router_upstream_errors_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{endpoint}} {{kind}}",
                        ),
                        Query(
                            "sum by (endpoint) (rate(leadtime_router_upstream_responses_total"
                            f'{{{ROUTER_INSTANCE}, status="5xx"}}{RATE}))',
                            "{{endpoint}} answered 5xx",
                        ),
                        Query(
                            "sum by (endpoint) "
                            f"(rate(leadtime_router_endpoint_ejections_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{endpoint}} taken out",
                        ),
                    ),
                    width=6,
                    min=0,
                ),
            ),
        ),
        Row(
            "P/D disaggregation and time-slicing",
            (
                Panel(
                    "P/D decisions per second",
                    "On a prefill/decode fleet: requests sent as a pair (prefill endpoint named to the decode one in "
                    "x-prefiller-host-port) and requests a decode endpoint prefilled itself.",
                    "ops",
                    (
                        Query(
                            f"sum by (decision) (rate(leadtime_router_pd_decisions_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{decision}}",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Share disaggregated",
                    "Share of P/D decisions that used a separate prefill endpoint.",
                    "percentunit",
                    (
                        Query(
                            _ratio(
                                f'leadtime_router_pd_decisions_total{{{ROUTER_INSTANCE}, decision="disaggregated"}}',
                                f"leadtime_router_pd_decisions_total{{{ROUTER_INSTANCE}}}",
                                "instance",
                            ),
                            "{{instance}}",
                        ),
                    ),
                    width=8,
                    min=0,
                    max=1,
                ),
                Panel(
                    "Candidates left out by time-slicing",
                    "Candidate endpoints per second left out because their accelerator's time-slice group was not "
                    "serving the inference job, and failed reads of the group states per second.",
                    "ops",
                    (
                        Query(
                            f"sum(rate(leadtime_router_timeslice_filtered_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "left out per second",
                        ),
                        Query(
                            f"sum(rate(leadtime_router_timeslice_source_errors_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "failed reads per second",
                        ),
                    ),
                    width=8,
                    min=0,
                    main=True,
                ),
                Panel(
                    "Time-slice groups serving",
                    "Per group, whether the gateway takes it as serving the inference job or away.",
                    "none",
                    (
                        Query(
                            f"max by (group) (leadtime_router_timeslice_group_serving{{{ROUTER_INSTANCE}}})",
                            "{{group}}",
                        ),
                    ),
                    kind="state",
                    width=12,
                    states=((0, "away", "orange"), (1, "serving", "green")),
                ),
                Panel(
                    "Age of the time-slice states",
                    "How old the group states the gateway routes on are: they stop being read when their source "
                    "fails, and the last states read are routed on meanwhile.",
                    "s",
                    (
                        Query(
                            f"max by (instance) (leadtime_router_timeslice_states_age_seconds{{{ROUTER_INSTANCE}}})",
                            "{{instance}}",
                        ),
                    ),
                    width=12,
                    min=0,
                ),
            ),
        ),
        Row(
            "Endpoints and feedback",
            (
                Panel(
                    "Endpoints by routability",
                    "Discovered endpoints that can be routed to (a recent good /metrics scrape), and those that "
                    "cannot.",
                    "short",
                    (
                        Query(
                            f"sum by (routable) (leadtime_router_endpoints{{{ROUTER_INSTANCE}}})",
                            "routable={{routable}}",
                        ),
                    ),
                    width=8,
                    min=0,
                ),
                Panel(
                    "Scrape age by endpoint",
                    "Age of each endpoint's last good /metrics scrape: the state the router decides on is this old.",
                    "s",
                    (
                        Query(
                            f"max by (endpoint) (leadtime_router_scrape_age_seconds{{{ROUTER_INSTANCE}, "
                            f'endpoint=~"$endpoint"}})',
                            "{{endpoint}}",
                        ),
                    ),
                    width=8,
                    min=0,
                ),
                Panel(
                    "Observations sent back to the predictor",
                    "Completed requests reported to the predictor per second: queued, sent, failed attempts to "
                    "send (each stays queued and is sent again: no loss) and dropped (the queue of 20,000 was full "
                    "while the predictor was away, or the predictor refused that one observation for good); "
                    "leadtime_router_observations_waiting says how many wait now.",
                    "ops",
                    (
                        Query(
                            f"sum by (result) (rate(leadtime_router_observations_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{result}}",
                        ),
                    ),
                    width=8,
                    min=0,
                ),
            ),
        ),
        Row(
            "Gateway replicas (--replicas-redis)",
            (
                Panel(
                    "Ledger changes shared per second",
                    "What this gateway told the other replicas of its group (sent), heard from them (received), "
                    "could not publish (dropped: Redis away or the queue full), messages that were not a "
                    "replica's (refused), and other replicas' requests whose completion it missed, let go of at "
                    "their replica's next heartbeat (missed). All 0 without --replicas-redis.",
                    "ops",
                    (
                        Query(
                            "sum by (direction) "
                            f"(rate(leadtime_router_replica_events_total{{{ROUTER_INSTANCE}}}{RATE}))",
                            "{{direction}}",
                        ),
                    ),
                    width=12,
                    min=0,
                ),
                Panel(
                    "Other replicas and their requests in flight",
                    "Replicas of the group heard within the last few seconds, and the requests they have in flight "
                    "as this gateway knows them (counted beside its own in what it adds to each endpoint's state).",
                    "short",
                    (
                        Query(f"max(leadtime_router_replicas_heard{{{ROUTER_INSTANCE}}})", "replicas heard"),
                        Query(
                            f"sum(leadtime_router_replica_requests_in_flight{{{ROUTER_INSTANCE}}})",
                            "their requests in flight",
                        ),
                    ),
                    width=12,
                    min=0,
                ),
            ),
        ),
    ),
)

DASHBOARDS = (PREDICTOR, ROUTER)
