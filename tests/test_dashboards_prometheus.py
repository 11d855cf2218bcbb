"""The dashboards against live metrics: every PromQL expression of every panel, evaluated by a real Prometheus.

One stack for the module (`leadtime.bench.dashboards.DashboardStack`): `leadtime sim serve` (a P/D fleet of three
accelerator classes, one prefill endpoint time-sliced), `leadtime serve` on a real Redis, `leadtime route` in
front of the fleet, and `prometheus` with the shipped scrape configuration, scraping both every second. About
twelve seconds of streaming traffic through the gateway (SLO headers, short and long prompts) and some gRPC
predictions, then every query of the shipped JSON goes to Prometheus's HTTP API the way Grafana sends it: a range
query over the traffic with a 2 s step (an instant query for stat panels), `$__rate_interval` =
max(step + scrape interval, 4 × scrape interval) = 4 s, `$__interval` = the step, `$__range` = the range, and
template variables at All (`.*`) or, in the variable test, at each value they list. "Returns data" means at least
one series with a finite value (a ratio of empty rates is NaN, which is no data).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import require_prometheus, require_redis_server
from redis_server import RedisServer
from test_dashboards import alert_rules
from waiting import wait_for

from leadtime.bench.dashboards import DashboardStack, Traffic
from leadtime.dashboards.definitions import DASHBOARDS
from leadtime.dashboards.files import load_dashboards
from leadtime.dashboards.promql import PanelQuery, for_prometheus, metric_names, panel_queries, variables_used
from leadtime.dashboards.render import PrometheusApi, Series, render_dashboard

STEP_S = 2.0
SCRAPE_S = 1.0
SHIPPED = load_dashboards()
QUERIES = [q for board in SHIPPED.values() for q in panel_queries(board)]


@dataclass
class Live:
    stack: DashboardStack
    traffic: Traffic
    api: PrometheusApi
    start: float
    end: float

    def evaluate(self, query: PanelQuery, values: dict[str, str] | None = None) -> list[Series]:
        expr = for_prometheus(query.expr, STEP_S, SCRAPE_S, self.end - self.start, values)
        if query.instant:
            return self.api.query(expr, self.end)
        return self.api.query_range(expr, self.start, self.end, STEP_S)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prometheus, redis_binary = require_prometheus(), require_redis_server()
    workdir = tmp_path_factory.mktemp("dashboards")
    redis = RedisServer(redis_binary, workdir)
    redis.start()
    try:
        with DashboardStack(workdir, prometheus, redis.url, scrape_interval_s=SCRAPE_S) as stack:
            assert stack.prometheus is not None
            traffic = stack.drive(12.0, lambda _: 4)
            api = PrometheusApi(stack.prometheus.url)
            # The learner (nice 10) retrains beside the traffic: on a busy machine its first retrain ends after it.
            wait_for(lambda: _retrained(api), timeout_s=60, what="a retrain scraped")
            time.sleep(2.5 * SCRAPE_S)  # the last counts scraped
            yield Live(stack, traffic, api, traffic.started, time.time())
    finally:
        redis.stop()


def _retrained(api: PrometheusApi) -> bool:
    return any(
        s.has_data and s.values.max() > 0 for s in api.query("leadtime_retrain_duration_seconds_count", time.time())
    )


def test_the_traffic_went_through(live: Live) -> None:
    assert live.traffic.requests >= 40 and live.traffic.errors == 0
    assert live.traffic.grpc_predictions >= 5


@pytest.mark.parametrize("query", QUERIES, ids=[q.name for q in QUERIES])
def test_every_panel_query_parses_and_returns_data(live: Live, query: PanelQuery) -> None:
    series = live.evaluate(query)  # a query Prometheus cannot parse raises PrometheusError (bad_data)
    assert any(s.has_data for s in series), f"no data: {query.expr}"


def test_every_variable_lists_values_and_every_query_it_filters_has_data_at_one_of_them(live: Live) -> None:
    # At All (`.*`) a matcher on a misspelt label still matches everything; at a listed value it matches nothing.
    for board in SHIPPED.values():
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            name = variable["name"]
            metric = variable["definition"].removeprefix("label_values(").split(",")[0]
            values = live.api.label_values(name, metric)
            assert values, f"{board['uid']}: ${name} lists nothing"
            for query in panel_queries(board):
                if name in variables_used(query.expr):
                    found = [v for v in values if any(s.has_data for s in live.evaluate(query, {name: v}))]
                    assert found, f"{query.name}: no data for any ${name} in {values}"


def test_every_metric_a_dashboard_names_reached_prometheus(live: Live) -> None:
    """Every counter a panel reads has its series before its first event (rejected observations, an endpoint's
    errors and 5xx answers among them): rate() never counts a series' first value."""
    scraped = set(httpx.get(f"{live.api.url}/api/v1/label/__name__/values", timeout=10).json()["data"])
    named = {n for q in QUERIES for n in metric_names(q.expr)}
    assert named <= scraped, sorted(named - scraped)


def test_the_store_panel_sees_redis_up_and_coverage_has_its_target(live: Live) -> None:
    (up,) = live.api.query('leadtime_store_up{component="redis"}', live.end)
    assert up.values.tolist() == [1.0]
    (quantile,) = live.api.query("leadtime_model_quantile", live.end)
    assert quantile.values.tolist() == [0.9]


def test_render_draws_every_main_panel_with_data(live: Live, tmp_path: Path) -> None:
    minutes = (live.end - live.start) / 60
    for board in DASHBOARDS:
        path, panels = render_dashboard(board, live.api, tmp_path, minutes=minutes, end=live.end)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
        assert len(panels) >= 6 and all(p.has_data for p in panels), [p.panel.title for p in panels if not p.has_data]


def test_prometheus_evaluates_every_alerting_rule_and_none_fires_on_a_healthy_stack(live: Live) -> None:
    """The shipped rules (loaded through prometheus.yml's rule_files) run against the real metrics: a rule naming a
    label the metrics lack evaluates to nothing rather than erring, so each is also checked to have evaluated."""
    deadline = time.time() + 30
    while True:
        groups = httpx.get(f"{live.api.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        if rules and all(rule.get("lastEvaluation", "").startswith("2") for rule in rules) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(rules) == len(alert_rules()) == 15, [r["name"] for r in rules]
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [(r["name"], [alert["labels"] for alert in r.get("alerts", [])]) for r in rules if r["state"] == "firing"]
    assert firing == []
