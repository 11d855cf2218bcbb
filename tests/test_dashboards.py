"""The dashboards as files: written from their definitions, Grafana's conventions kept, every metric they name
exported by the service or the gateway, the provisioning files consistent, the commands' errors one line."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import require_prometheus
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from leadtime.cli import app
from leadtime.dashboards.definitions import DASHBOARDS, PREDICTOR
from leadtime.dashboards.files import FOLDER, dashboard_files, dashboard_text, load_dashboards
from leadtime.dashboards.promql import (
    exposed_names,
    for_prometheus,
    iter_panels,
    metric_names,
    panel_queries,
    variables_used,
)
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings
from leadtime.router_plugin.gateway.metrics import GatewayMetrics

BUILTINS = {"__rate_interval", "__interval", "__range"}
SHIPPED = load_dashboards()


@contextlib.contextmanager
def json_server(status: int, answer: object) -> Iterator[str]:
    """A loopback HTTP server answering every GET with `status` and `answer` as JSON; its URL."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_the_shipped_json_is_what_the_definitions_write() -> None:
    # One source of truth: edit dashboards/definitions.py, then `leadtime dashboards build`.
    for board, path in zip(DASHBOARDS, dashboard_files(), strict=True):
        assert path.read_text(encoding="utf-8") == dashboard_text(board), f"{path.name} is stale"


@pytest.mark.parametrize(
    ("uid", "variables"),
    [
        ("leadtime-predictor", {"instance", "accelerator", "role"}),
        ("leadtime-router", {"instance", "accelerator", "endpoint"}),
    ],
)
def test_grafana_conventions(uid: str, variables: set[str]) -> None:
    board = SHIPPED[uid]
    assert board["uid"] == uid and board["title"] and board["description"]
    templating = {v["name"]: v for v in board["templating"]["list"]}
    assert templating["datasource"]["type"] == "datasource" and templating["datasource"]["query"] == "prometheus"
    assert set(templating) == {"datasource", *variables}
    for name in variables:
        variable = templating[name]
        assert variable["type"] == "query" and variable["datasource"]["uid"] == "${datasource}"
        assert variable["includeAll"] and variable["allValue"] == ".*"
        assert variable["definition"].startswith("label_values(leadtime_")
        assert variable["definition"].endswith(f", {name})")  # lists the label it is named after
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert len(rows) >= 4 and all(r["title"] for r in rows)
    panels = list(iter_panels(board))
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:  # on the 24-column grid, no two panels overlap
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        cover = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cover & cells, panel["title"]
        cells |= cover
    used: set[str] = set()
    for panel in panels:
        title = panel["title"]
        assert len(panel["description"]) > 30, title
        assert panel["fieldConfig"]["defaults"]["unit"], title
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip(), title
            used |= variables_used(target["expr"])
    assert used - BUILTINS == variables  # every variable filters something, and nothing else is referenced
    assert "__rate_interval" in used


def variable_metric(definition: str) -> str:
    """The metric of `label_values(metric, label)`."""
    return definition.removeprefix("label_values(").split(",")[0]


def test_every_metric_a_dashboard_names_is_exported() -> None:
    with TestClient(create_app(ServiceSettings())) as client:
        service = exposed_names(client.get("/metrics").text)
    gateway = exposed_names(GatewayMetrics().render().decode())
    exporters = {"leadtime-predictor": service, "leadtime-router": gateway}
    for uid, board in SHIPPED.items():
        named = {n for q in panel_queries(board) for n in metric_names(q.expr)}
        named |= {variable_metric(v["definition"]) for v in board["templating"]["list"] if "definition" in v}
        assert len(named) > 15, uid
        assert named <= exporters[uid], f"{uid} names metrics nobody exports: {sorted(named - exporters[uid])}"


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((FOLDER / "provisioning" / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def rule_annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The annotations `alert` carries once its templates are filled with `labels`."""
    (rule,) = [r for r in alert_rules() if r["alert"] == alert]
    filled = {}
    for key, text in rule["annotations"].items():
        for name, value in labels.items():
            text = text.replace(f"{{{{ $labels.{name} }}}}", value)
        filled[key] = text
    return filled


def promtool_rule_tests(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    """Run promtool's unit tests of the shipped rules (evaluated each minute) over `tests`."""
    promtool = Path(require_prometheus()).with_name("promtool")
    spec = {"rule_files": [str(FOLDER / "provisioning" / "alerts.yml")], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(spec))
    checked = subprocess.run([str(promtool), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_metric_an_alert_names_is_exported() -> None:
    with TestClient(create_app(ServiceSettings())) as client:
        exported = exposed_names(client.get("/metrics").text) | exposed_names(GatewayMetrics().render().decode())
    named = {n for rule in alert_rules() for n in metric_names(rule["expr"])} - {"up"}
    assert len(named) >= 6 and named <= exported, sorted(named - exported)
    assert all(rule["annotations"]["summary"] and rule["labels"]["severity"] for rule in alert_rules())


def test_the_alerting_rules_pass_promtool_and_prometheus_yml_loads_them() -> None:
    promtool = Path(require_prometheus()).with_name("promtool")
    assert promtool.exists(), f"{promtool}: installed with prometheus"
    checked = subprocess.run(
        [str(promtool), "check", "config", str(FOLDER / "provisioning" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout


def test_the_model_pull_alert_fires_on_failing_pulls_alone(tmp_path: Path) -> None:
    """A prediction server (`--model-from`) or a gateway (`--pull-model`) whose pulls all fail serves an old model
    or the prior for as long as that lasts, with nothing routing goes wrong on to notice it by. promtool's rule
    tests: the service failing for 10 minutes, a gateway whose pulls are refused, a process whose pulls succeed
    between failures (no alert), one that pulls nothing (no alert)."""
    promtool_rule_tests(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f'{name}{{instance="{instance}",result="{result}"}}', "values": values}
                    for name, instance, result, values in [
                        ("leadtime_model_pulls_total", "p1", "error", "0+60x15"),
                        ("leadtime_model_pulls_total", "p1", "unchanged", "0x15"),
                        ("leadtime_model_pulls_total", "p2", "error", "0+30x15"),
                        ("leadtime_model_pulls_total", "p2", "unchanged", "0+30x15"),
                        ("leadtime_model_pulls_total", "p3", "error", "0x15"),
                        ("leadtime_router_model_pulls_total", "g1", "refused", "0+60x15"),
                        ("leadtime_router_model_pulls_total", "g1", "new", "1x15"),
                    ]
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "12m",
                        "alertname": "LeadtimeModelPullsFailing",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "instance": instance},
                                "exp_annotations": rule_annotations(
                                    "LeadtimeModelPullsFailing", {"instance": instance}
                                ),
                            }
                            for instance in ("g1", "p1")
                        ],
                    }
                ],
            }
        ],
    )


def test_observations_lost_to_capacity_alert_at_once_and_refused_rows_only_as_a_share(tmp_path: Path) -> None:
    """Rows lost to a full backlog, store or outage buffer are learning the service could not do: one is an alert.
    Rows the learner refuses (invalid, or implausible by the roofline) are the sender's: a stream bunched by a
    starved server now and then makes one, and a client in the wrong units or a poisoner makes most of its rows
    such. So those alert as a share of the rows the learner took in, over 1%, under their own name."""
    lost = "leadtime_observations_lost_total"
    learned = "leadtime_observations_learned_total"
    series = [
        (lost, "full", 'reason="backlog_full"', "0 0 0 5 5 5"),
        (learned, "full", "", "0+600x5"),
        (lost, "stray", 'reason="implausible"', "0 0 1 1 1 1"),  # one in 3,000: no alert
        (learned, "stray", "", "0+600x5"),
        (lost, "units", 'reason="implausible"', "0+100x5"),  # a sixth of the rows
        (learned, "units", "", "0+500x5"),
        (lost, "garbled", 'reason="invalid"', "0+20x5"),
        (learned, "garbled", "", "0+600x5"),
    ]
    input_series = [
        {"series": f'{name}{{instance="{instance}"{"," + labels if labels else ""}}}', "values": values}
        for name, instance, labels, values in series
    ]

    def expected(alert: str, instances: list[tuple[str, dict[str, str]]]) -> dict[str, Any]:
        return {
            "eval_time": "5m",
            "alertname": alert,
            "exp_alerts": [
                {
                    "exp_labels": {"severity": "warning", "instance": instance, **labels},
                    "exp_annotations": rule_annotations(alert, {"instance": instance, **labels}),
                }
                for instance, labels in instances
            ],
        }

    promtool_rule_tests(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": input_series,
                "alert_rule_test": [
                    expected("LeadtimeObservationsLost", [("full", {"reason": "backlog_full"})]),
                    expected("LeadtimeObservationsRefused", [("garbled", {}), ("units", {})]),
                ],
            }
        ],
    )


def _fires(alert: str, eval_time: str, instances: list[tuple[str, dict[str, str]]]) -> dict[str, Any]:
    """promtool's expectation that `alert` fires at `eval_time` for exactly these instances (and labels)."""
    return {
        "eval_time": eval_time,
        "alertname": alert,
        "exp_alerts": [
            {
                "exp_labels": {"severity": "warning", "instance": instance, **labels},
                "exp_annotations": rule_annotations(alert, {"instance": instance, **labels}),
            }
            for instance, labels in instances
        ],
    }


def _series(name: str, instance: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f'{name}{{instance="{instance}"{"," + labels if labels else ""}}}', "values": values}


def test_the_coverage_alert_fires_below_and_above_its_band_even_with_no_covered_decision(tmp_path: Path) -> None:
    """With no decision covered at all, `covered="true"` had no series and the rule's ratio was empty: coverage 0
    raised nothing. And `abs(coverage - 0.9) > 0.1` cannot hold above 0.9: too loose a quantile never fired."""
    checks = "leadtime_live_quantile_checks_total"
    series = [_series("leadtime_model_quantile", i, "", "0.9x90") for i in ("none", "all", "calibrated", "close")]
    series += [
        _series(checks, "none", 'target="ttft",covered="false"', "0+60x90"),
        _series(checks, "all", 'target="ttft",covered="true"', "0+60x90"),
        _series(checks, "all", 'target="ttft",covered="false"', "0x90"),
        _series(checks, "calibrated", 'target="ttft",covered="true"', "0+54x90"),
        _series(checks, "calibrated", 'target="ttft",covered="false"', "0+6x90"),
        _series(checks, "close", 'target="tpot",covered="true"', "0+51x90"),  # 0.85
        _series(checks, "close", 'target="tpot",covered="false"', "0+9x90"),
    ]
    expected = [("all", {"target": "ttft"}), ("none", {"target": "ttft"})]
    promtool_rule_tests(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [_fires("LeadtimeCoverageOffTarget", "60m", expected)],
            }
        ],
    )


def test_a_stalled_learner_failing_retrains_and_failing_endpoints_alert(tmp_path: Path) -> None:
    """Three failures nothing alerted on: rows waiting with none learned for 10 minutes (the learner stuck), every
    retrain failing for half an hour, and endpoints answering one request in ten with a 5xx (short of the five
    failures in a row that eject one)."""
    learned, pending = "leadtime_observations_learned_total", "leadtime_observations_pending"
    retrains, answers = "leadtime_retrains_total", "leadtime_router_upstream_responses_total"
    errors = "leadtime_router_upstream_errors_total"
    series = [
        _series(pending, "stuck", "", "500x40"),
        _series(learned, "stuck", "", "1000x40"),
        _series(pending, "idle", "", "0x40"),
        _series(learned, "idle", "", "1000x40"),
        _series(pending, "busy", "", "500x40"),
        _series(learned, "busy", "", "0+300x40"),
        _series(retrains, "broken", 'target="ttft",outcome="failed"', "0+1x40"),
        _series(retrains, "flaky", 'target="ttft",outcome="failed"', "0+1x40"),
        _series(retrains, "flaky", 'target="ttft",outcome="accepted"', "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 1x20"),
        _series(answers, "g-bad", 'endpoint="a",status="2xx"', "0+90x40"),
        _series(answers, "g-bad", 'endpoint="a",status="5xx"', "0+6x40"),
        _series(errors, "g-bad", 'endpoint="a",kind="connect"', "0+4x40"),
        _series(answers, "g-ok", 'endpoint="a",status="2xx"', "0+990x40"),
        _series(answers, "g-ok", 'endpoint="a",status="5xx"', "0+10x40"),
    ]
    promtool_rule_tests(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    _fires("LeadtimeLearnerStalled", "30m", [("stuck", {})]),
                    _fires("LeadtimeRetrainsFailing", "38m", [("broken", {})]),
                    _fires("LeadtimeEndpointErrors", "30m", [("g-bad", {})]),
                ],
            }
        ],
    )


def test_no_query_by_label_adds_an_unlabelled_zero() -> None:
    """`sum by (endpoint) (...) or vector(0)` adds a series with no labels beside the endpoints' own, a legend
    entry with its label empty (" taken out"); the counters those queries read are exported at 0 instead."""
    for board in SHIPPED.values():
        for query in panel_queries(board):
            assert not ("or vector(0)" in query.expr and "sum by" in query.expr), query.name


def test_the_itl_panel_draws_the_mean_beside_the_median() -> None:
    """A median is interpolated inside one histogram bucket; the mean, from _sum and _count, is exact: a change in
    decode speed shows in it whatever the buckets."""
    (panel,) = [p for p in iter_panels(SHIPPED["leadtime-router"]) if p["title"].startswith("ITL of routed requests")]
    exprs = [t["expr"] for t in panel["targets"]]
    assert any("leadtime_router_itl_seconds_sum" in e and "leadtime_router_itl_seconds_count" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e for e in exprs)


def _is_rate(expr: str) -> bool:
    """A plain per-second rate: a rate() neither divided nor a quantile."""
    return "rate(" in expr and "/" not in expr and "histogram_quantile" not in expr


def test_per_second_panels_plot_rates_and_rates_are_drawn_per_second() -> None:
    """Regressions: "Requests per second by status" drew the requests in flight (a count) on its requests/s axis;
    "Candidates left out by time-slicing" drew rates on a plain axis."""
    for board in DASHBOARDS:
        for panel in board.panels():
            if panel.kind != "timeseries":
                continue
            rates = [_is_rate(q.expr) for q in panel.queries]
            if panel.unit in ("ops", "reqps"):
                assert all(rates), panel.title
            elif any(rates):
                raise AssertionError(f"{panel.title}: rates drawn in {panel.unit}")


def test_a_gauge_in_seconds_is_drawn_only_on_an_axis_in_seconds() -> None:
    """Regression: "Time-slice groups serving" put a 0/1 state and the states' age in seconds on one plain axis."""
    for board in DASHBOARDS:
        for panel in board.panels():
            seconds = {n for q in panel.queries for n in metric_names(q.expr) if n.endswith("_seconds")}
            assert panel.unit == "s" or not seconds, (panel.title, seconds)


def test_the_http_latency_panel_leaves_out_the_scrapes_of_metrics() -> None:
    """/metrics (a Prometheus scrape, ~25 ms at the p99) set the panel's scale and pushed the hot path out of its
    legend."""
    (panel,) = [p for p in PREDICTOR.panels() if p.title.startswith("HTTP latency by path")]
    assert all('path!="/metrics"' in q.expr for q in panel.queries)


def test_the_grpc_latency_panel_leaves_out_the_client_streams() -> None:
    """An ObserveStream is timed for the stream's whole life (a client sending batches as they come): one open 4 s
    fell above the top bucket, and the panel read 2.5 s at its p50 and p99, setting the scale over PredictBulk's
    milliseconds."""
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    methods = pb.DESCRIPTOR.services_by_name["Predictor"].methods
    streams = [m.name for m in methods if m.client_streaming]
    assert streams == ["ObserveStream"]
    (panel,) = [p for p in PREDICTOR.panels() if p.title.startswith("gRPC latency by method")]
    assert all('method!~"ObserveStream"' in q.expr for q in panel.queries)
    assert "ObserveStream" in panel.description


def test_metric_names_reads_past_labels_functions_and_keywords() -> None:
    expr = (
        'sum by (reason) (rate(a_total{x=~"$v"}[$__rate_interval]))\n/ ignoring (reason) group_left\n'
        'sum(rate(b_count{le="0.5"}[5m])) or vector(0) > bool 1e3'
    )
    assert metric_names(expr) == {"a_total", "b_count"}
    assert variables_used(expr) == {"v", "__rate_interval"}
    with pytest.raises(ValueError, match=r"\$__from"):
        for_prometheus("x[$__from]", 1, 1, 1)


def test_provisioning_files_point_at_the_dashboards_and_a_prometheus() -> None:
    provisioning = FOLDER / "provisioning"
    providers = yaml.safe_load((provisioning / "dashboards" / "leadtime.yaml").read_text())["providers"]
    assert providers[0]["type"] == "file" and providers[0]["options"]["path"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "leadtime-prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http") and source["jsonData"]["timeInterval"]
    scrape = yaml.safe_load((provisioning / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == {"leadtime-predictor", "leadtime-router"}
    assert all(job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] for job in jobs.values())
    assert scrape["global"]["scrape_interval"] == source["jsonData"]["timeInterval"]


def test_build_writes_the_shipped_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["dashboards", "build", "--out", str(tmp_path / "grafana")])
    assert result.exit_code == 0, result.output
    for path in dashboard_files():
        written: dict[str, Any] = json.loads((tmp_path / "grafana" / path.name).read_text())
        assert written == SHIPPED[written["uid"]]


def test_build_without_out_writes_into_the_working_directory_not_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It wrote into the package's folder: from an installed wheel, into site-packages."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["dashboards", "build"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "dashboards").iterdir()) == [p.name for p in dashboard_files()]


def test_provisioning_writes_the_shipped_grafana_and_prometheus_files(tmp_path: Path) -> None:
    """The README says to copy them, and only a checkout had them where a user could see them."""
    result = CliRunner().invoke(app, ["dashboards", "provisioning", "--out", str(tmp_path / "prov")])
    assert result.exit_code == 0, result.output
    shipped = FOLDER / "provisioning"
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "prov") for p in (tmp_path / "prov").rglob("*") if p.is_file())
    assert all((tmp_path / "prov" / f).read_bytes() == (shipped / f).read_bytes() for f in files)


def test_render_without_a_prometheus_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["dashboards", "render", "--prometheus", "http://127.0.0.1:1", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Prometheus at http://127.0.0.1:1 cannot be reached")
    assert "Traceback" not in result.output
    bad = CliRunner().invoke(
        app, ["dashboards", "render", "--prometheus", "x", "--out", str(tmp_path), "--minutes", "0"]
    )
    assert bad.exit_code == 2 and "--minutes must be > 0" in bad.output


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("notaurl", "--prometheus 'notaurl': not an http:// or https:// URL"),
        ("ftp://prometheus:9090", "--prometheus 'ftp://prometheus:9090': not an http:// or https:// URL"),
        ("http://", "--prometheus 'http://': not an http:// or https:// URL"),
        ("http://[::1", "--prometheus 'http://[::1': not an http:// or https:// URL (Invalid IPv6 URL)"),  # traceback
        ("http://127.0.0.1:99999", "--prometheus 'http://127.0.0.1:99999': not an http:// or https:// URL (Port"),
        ("http://127.0.0.1:1", "Prometheus at http://127.0.0.1:1 cannot be reached"),
    ],
)
def test_render_makes_no_folder_for_a_prometheus_it_cannot_ask(tmp_path: Path, url: str, problem: str) -> None:
    """`--prometheus notaurl --out o/x` made o/x, then said the URL had no scheme."""
    out = tmp_path / "o" / "x"
    result = CliRunner().invoke(app, ["dashboards", "render", "--prometheus", url, "--out", str(out)])
    assert result.exit_code == 2 and result.output.startswith(f"error: {problem}"), result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_render_against_a_server_that_is_not_prometheus_says_so(tmp_path: Path) -> None:
    """Pointed at the service instead of Prometheus it said "error: 404: Not Found"."""
    with json_server(404, {"detail": "Not Found"}) as url:
        result = CliRunner().invoke(app, ["dashboards", "render", "--prometheus", url, "--out", str(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{url} does not answer as Prometheus's HTTP API" in result.output and "404" in result.output


def test_build_into_a_file_says_a_folder_is_needed(tmp_path: Path) -> None:
    in_the_way = tmp_path / "leadtime-predictor.json"
    in_the_way.write_text("{}")
    result = CliRunner().invoke(app, ["dashboards", "build", "--out", str(in_the_way)])
    assert result.exit_code == 2 and "a file is in the way (a folder is needed)" in result.output


def test_a_rendered_legend_stays_inside_its_panel_however_many_series() -> None:
    """Regression: "HTTP latency by path" had one legend entry per path and quantile (~50 once the service had
    answered ~25 paths), and its legend ran over the panels below, covering their titles."""
    import matplotlib.pyplot as plt
    import numpy as np

    from leadtime.dashboards.grafana import Panel, Query
    from leadtime.dashboards.render import LABEL_CHARS, LEGEND_SERIES, PanelData, Series, draw_panels, shorten

    times = 1_767_225_600.0 + np.arange(0.0, 600.0, 10.0)

    def panel(title: str, names: list[str]) -> PanelData:
        drawn = Panel(title, "", "s", (Query("x", "{{path}}"),), main=True)
        return PanelData(
            drawn, [(n, Series({}, times, np.full(len(times), 0.001 * (i + 1)))) for i, n in enumerate(names)]
        )

    paths = [f"/some/long/route/of/the/service/number/{i}/and/more {q}" for i in range(25) for q in ("p50", "p99")]
    panels = [panel("HTTP latency by path (p50, p99)", paths), panel("b", ["one"]), panel("c", []), panel("d", ["x"])]
    fig = draw_panels("test", panels, times[0], times[0] + 600.0)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            if ax.get_legend() is None:
                continue
            inside, box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
            assert box.x0 <= inside.x0 and inside.x1 <= box.x1 and box.y0 <= inside.y0 and inside.y1 <= box.y1, (
                ax.get_title(),
                inside,
                box,
            )
        texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        # The series that peak highest are named (shortened), in drawing order; the rest summed up in one entry.
        highest = sorted(paths[-LEGEND_SERIES:])
        assert texts == [shorten(name) for name in highest] + [f"+{50 - LEGEND_SERIES} more"], texts
        assert all(len(t) == LABEL_CHARS and t.endswith(("/and/more p50", "/and/more p99")) for t in texts[:-1])
        assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["one"]
    finally:
        plt.close(fig)


def test_every_rendered_panel_spans_the_time_range_asked_for() -> None:
    """A panel whose data stopped early was drawn up to its last point, so it looked as current as the others."""
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    import numpy as np

    from leadtime.dashboards.grafana import Panel, Query
    from leadtime.dashboards.render import PanelData, Series, draw_panels

    start, end = 1_767_225_600.0, 1_767_225_600.0 + 600.0
    early = start + np.arange(0.0, 300.0, 10.0)  # stopped halfway
    panels = [
        PanelData(Panel(title, "", "s", (Query("x", "x"),), main=True), series)
        for title, series in (("stopped", [("x", Series({}, early, np.ones(len(early))))]), ("empty", []))
    ]
    fig = draw_panels("test", panels, start, end)
    try:
        asked = [mdates.date2num(datetime.fromtimestamp(t)) for t in (start, end)]  # as the series are drawn
        for ax in fig.axes[: len(panels)]:
            assert list(ax.get_xlim()) == pytest.approx(asked), ax.get_title()
    finally:
        plt.close(fig)


def test_a_series_missing_steps_is_drawn_with_a_gap_not_a_line_across_them() -> None:
    """Regression: Prometheus leaves out the steps where an expression has no value (a service down); only the
    points it returned were kept, and the picture joined the last one before to the first one after: a minute's
    outage read as steady traffic. Every step of the range is a point, NaN where there was no value."""
    import numpy as np

    from leadtime.dashboards.render import PrometheusApi

    start, step = 1_767_225_600.0, 1.0
    answered = [start + k for k in (0, 1, 2, 60, 61, 62)]  # nothing from 3 s to 59 s

    result = [{"metric": {"api": "native"}, "values": [[t, "40"] for t in answered]}]
    with json_server(200, {"status": "success", "data": {"resultType": "matrix", "result": result}}) as url:
        (series,) = PrometheusApi(url).query_range("x", start, start + 62.5, step)
    assert series.times.tolist() == [start + k for k in range(63)]  # each step of the range, end included
    assert np.isnan(series.values[3:60]).all() and series.values[[0, 1, 2, 60, 61, 62]].tolist() == [40.0] * 6
