"""Auth on write paths, body size limits, JSON errors and Prometheus metrics."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient
from waiting import wait_for

from leadtime.bench.procs import Child
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.hosts import check_allowed_host, host_allowed
from leadtime.predictor.settings import ServiceSettings


def row() -> dict[str, Any]:
    return {
        "kv_cache_percentage": 0.1,
        "input_token_length": 300,
        "num_request_waiting": 0,
        "num_request_running": 2,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
    }


def entry() -> dict[str, Any]:
    return dict(row(), actual_ttft_ms=120.0, actual_tpot_ms=0.0)


def test_write_paths_need_the_token_and_read_paths_stay_open() -> None:
    with TestClient(create_app(ServiceSettings(api_token="s3cret"))) as c:
        writes = [
            ("/add_training_data_bulk", {"entries": [entry()]}),
            ("/v1/observations", {"observations": [entry()]}),
            ("/reload", None),
            ("/flush", None),
        ]
        for path, body in writes:
            c.headers["content-type"] = "application/json"  # given even with no body: write paths need it
            r = c.post(path, json=body)
            assert r.status_code == 401, path
            assert "Bearer" in r.json()["error"] and r.headers["www-authenticate"] == "Bearer"
            wrong = c.post(path, json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401, path
            ok = c.post(path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code in (200, 202), path
        assert c.post("/predict/bulk/strict", json={"requests": [row()]}).status_code == 200
        assert c.post("/v1/predict", json={"rows": [row()]}).status_code == 200
        for path in ("/status", "/metrics", "/models/list", "/healthz", "/readyz", "/data/status"):
            assert c.get(path).status_code == 200, path


def test_a_write_without_the_token_is_refused_before_its_body_is_read() -> None:
    """The edge read each body whole (16 MiB a connection) before the route refused its missing token: a dozen
    slow senders held 180 MB without one. A write path that needs the token says so at its headers."""
    import asyncio

    app = create_app(ServiceSettings(api_token="s3cret"))
    for path in ("/add_training_data_bulk", "/v1/observations", "/flush"):
        reads: list[int] = []
        sent: list[dict[str, Any]] = []

        async def receive(reads: list[int] = reads) -> dict[str, Any]:
            reads.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}

        async def send(message: dict[str, Any], sent: list[dict[str, Any]] = sent) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer nope")]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
        asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
        assert sent[0]["status"] == 401 and reads == [], (path, sent[:1], len(reads))
        assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
        body = orjson.loads(sent[1]["body"])
        assert "Bearer" in body["error"] and body["detail"] == body["error"]


def test_without_a_token_writes_are_open() -> None:
    with TestClient(create_app(ServiceSettings())) as c:
        assert c.post("/add_training_data_bulk", json={"entries": [entry()]}).status_code == 202


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        ("leadtime.svc", True),
        ("leadtime.svc:8000", True),  # the port is not compared
        ("LeadTime.SVC", True),  # nor the case
        ("leadtime.svc.:8000", True),  # nor a trailing dot (the same name to DNS)
        ("10.0.0.7:8000", True),
        ("[::1]:8000", True),
        ("[0:0:0:0:0:0:0:1]", True),  # the same IPv6 address, written out
        ("a.example.com", True),
        ("b.a.example.com:443", True),
        ("example.com", False),  # `*.example.com` is its subdomains, as Starlette's TrustedHostMiddleware reads it
        ("badexample.com", False),
        ("evil.example", False),
        ("leadtime.svc.evil.example", False),
        ("[::2]:8000", False),
        ("[::1", False),  # malformed
        ("", False),  # sent empty
        (None, False),  # not sent
    ],
)
def test_a_host_is_allowed_by_name_address_or_wildcard(header: str | None, allowed: bool) -> None:
    entries = tuple(check_allowed_host(e) for e in ("leadtime.svc", "10.0.0.7", "::1", "*.example.com"))
    assert host_allowed(header, entries) is allowed
    assert host_allowed(header, ())  # no list: every host, as without the option
    assert host_allowed(header, ("*",))  # `*` alone: every host


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("", "empty"),
        ("local host", "spaces"),
        ("bad\x00host", "control"),
        ("http://leadtime.svc", "without scheme or path"),
        ("leadtime.svc/v1", "without scheme or path"),
        ("localhost:8000", "give the host without it ('localhost')"),
        ("[::1]:8000", "give the host without it ('[::1]')"),
        ("[::1", "not an IPv6 address in brackets"),
        ("host:name", "neither a host name nor an IPv6 address"),
        ("foo*.example.com", "a wildcard is '*' alone"),
        ("*example.com", "a wildcard is '*' alone"),
        ("under@score", "not a host name"),
    ],
)
def test_an_allowed_host_no_header_could_match_is_refused_saying_why(entry: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        check_allowed_host(entry)


def test_a_foreign_host_is_refused_with_400_before_the_token_and_nothing_is_learned() -> None:
    """DNS rebinding: a page on evil.example whose name resolves to the service is same-origin to the browser, and
    its requests carry `Host: evil.example`. With --allowed-host they are refused before anything else is checked
    or read; the probes and /metrics answer whatever the Host (kubelet and Prometheus name the pod by its IP)."""
    settings = ServiceSettings(allowed_hosts=("leadtime.svc", "*.example.com"), api_token="s3cret")
    with TestClient(create_app(settings), base_url="http://leadtime.svc:8000") as c:
        before = c.get("/status").json()["ingestion"]["accepted"]
        auth = {"Authorization": "Bearer s3cret"}
        evil = {"Host": "evil.example", **auth}
        for method, path in (("POST", "/v1/observations"), ("POST", "/add_training_data_bulk"), ("GET", "/status")):
            body = {"observations": [entry()]} if path == "/v1/observations" else {"entries": [entry()]}
            r = c.request(method, path, json=body if method == "POST" else None, headers=evil)
            assert r.status_code == 400, (path, r.text)
            assert r.json() == {
                "error": "Host 'evil.example' is not an allowed host (--allowed-host)",
                "field": "host",
                "detail": "Host 'evil.example' is not an allowed host (--allowed-host)",
            }
        unauthorized = c.post("/v1/observations", json={"observations": [entry()]}, headers={"Host": "evil.example"})
        assert unauthorized.status_code == 400  # the Host first: the token is not what refuses it
        long = c.get("/status", headers={"Host": "x" * 20_000})
        assert long.status_code == 400 and len(long.json()["error"]) < 120
        assert c.get("/status").json()["ingestion"]["accepted"] == before  # nothing learned
        accepted = c.post("/v1/observations", json={"observations": [entry()]}, headers=auth)
        assert accepted.status_code == 202, accepted.text
        sub = c.post("/v1/observations", json={"observations": [entry()]}, headers={"Host": "a.example.com", **auth})
        assert sub.status_code == 202, sub.text
        for path in ("/healthz", "/readyz", "/metrics"):
            assert c.get(path, headers={"Host": "10.1.2.3:8000"}).status_code == 200, path
            assert c.head(path, headers={"Host": "10.1.2.3:8000"}).status_code == 200, path
        assert c.get("/", headers={"Host": "10.1.2.3:8000"}).status_code == 400


def test_a_request_with_no_host_is_refused_when_hosts_are_listed_and_answered_when_not() -> None:
    """HTTP/1.0 may send no Host: with a list it cannot be told from a rebound page's, and is refused."""
    import asyncio

    def status(settings: ServiceSettings) -> tuple[int, dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b""}
        asyncio.run(create_app(settings)(scope, receive, send))  # type: ignore[arg-type]
        return sent[0]["status"], orjson.loads(sent[1]["body"])

    code, body = status(ServiceSettings(allowed_hosts=("leadtime.svc",)))
    assert code == 400 and "no Host header" in body["error"] and body["field"] == "host", body
    assert status(ServiceSettings())[0] == 200


def test_bodies_over_the_limit_get_413_declared_or_streamed() -> None:
    with TestClient(create_app(ServiceSettings(max_body_bytes=2_000))) as c:
        small = c.post("/predict/bulk/strict", json={"requests": [row()]})
        assert small.status_code == 200
        big = c.post("/predict/bulk/strict", json={"requests": [row()] * 50})
        assert big.status_code == 413
        assert "2,000 bytes" in big.json()["error"]
        assert big.json()["detail"] == big.json()["error"]  # the shape of every other error body (FastAPI's detail)
        plain = c.post("/add_training_data_bulk", content=b"{}", headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and plain.json()["detail"] == plain.json()["error"]

        def chunks() -> Any:  # no Content-Length: the limit must hold on the streamed size too
            yield b'{"requests": ['
            for _ in range(50):
                yield b'{"kv_cache_percentage": 0.1, "input_token_length": 3},'
            yield b"]}"

        streamed = c.post("/add_training_data_bulk", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert c.get("/status").status_code == 200  # the service carries on


def test_more_training_entries_than_a_call_takes_are_over_the_body_limit_first() -> None:
    """Over HTTP the 16 MiB limit answers 413 before the 100,000-entry cap could answer 422: the shortest llm-d
    entry (its eight required fields) takes more than 16 MiB / 100,000 bytes, so the README says 413."""
    from leadtime.predictor.service.runtime import MAX_OBSERVATIONS_PER_CALL

    settings = ServiceSettings()
    shortest = dict.fromkeys([*row(), "actual_ttft_ms", "actual_tpot_ms"], 0)
    assert len(orjson.dumps(shortest)) + 1 > settings.max_body_bytes / MAX_OBSERVATIONS_PER_CALL
    with TestClient(create_app(settings)) as c:
        body = orjson.dumps({"entries": [shortest] * (MAX_OBSERVATIONS_PER_CALL + 1)})
        answer = c.post("/add_training_data_bulk", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 413, answer.text[:200]


def test_metrics_scrape_has_the_leadtime_families() -> None:
    with TestClient(create_app(ServiceSettings())) as c:
        for _ in range(3):
            c.post("/predict/bulk/strict", json={"requests": [row(), row()]})
        c.post("/predict/bulk/strict", json={"requests": [{"nope": 1}]})
        c.post("/add_training_data_bulk", json={"entries": [entry(), entry()]})
        c.post("/add_training_data_bulk", json={"entries": [{"bad": True}]})
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        expected = [
            'leadtime_http_requests_total{method="POST",path="/predict/bulk/strict",status="200"} 3.0',
            'leadtime_http_requests_total{method="POST",path="/predict/bulk/strict",status="422"} 1.0',
            'leadtime_http_request_duration_seconds_count{path="/predict/bulk/strict"} 4.0',
            'leadtime_predictions_total{api="llmd"} 6.0',
            'leadtime_observations_accepted_total{api="llmd"} 2.0',
            'leadtime_observations_rejected_total{api="llmd"} 1.0',
            'leadtime_observations_lost_total{reason="backlog_full"} 0.0',
            "leadtime_model_version 0.0",
            "leadtime_model_age_seconds",
            "leadtime_model_quantile 0.9",
            'leadtime_store_up{component="store"} 1.0',
            'leadtime_retrains_total{outcome="failed",target="tpot"} 0.0',  # every outcome exported from the start
            'leadtime_window_samples{target="ttft"}',
            "# TYPE leadtime_retrain_duration_seconds histogram",
            "# TYPE leadtime_live_absolute_percentage_error_ratio histogram",
            # llm-d's training-server lines, in its own shape
            'model_type{type="lightgbm"} 1',
            'objective_type{type="quantile"} 1',
            "model_quantile{} 0.9",
            "ensemble_active{} 0",
            "ensemble_mode{} 0",
            'training_samples_count{model="ttft"} 2',
        ]
        for line in expected:
            assert line in text, line


def test_counters_by_api_and_grpc_method_are_exported_at_0_before_the_first_call() -> None:
    """rate() and increase() count a counter's steps, not its first value: a series that appears with its first
    call at 200 showed none of those 200 calls (the first gRPC predictions, the first refused batch)."""
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    with TestClient(create_app(ServiceSettings())) as c:
        text = c.get("/metrics").text
    for api in ("llmd", "native", "grpc"):
        for family in ("predictions", "observations_accepted", "observations_rejected"):
            assert f'leadtime_{family}_total{{api="{api}"}} 0.0' in text, (family, api)
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["Predictor"].methods]
    assert "PredictBulk" in methods
    for method in methods:
        assert f'leadtime_grpc_requests_total{{code="OK",method="{method}"}} 0.0' in text, method
        assert f'leadtime_grpc_request_duration_seconds_count{{method="{method}"}} 0.0' in text, method


def test_requests_by_route_and_grpc_calls_by_status_code_are_exported_at_0_before_the_first() -> None:
    """The first answers of a route (a first burst of predictions), and the first UNAVAILABLE or INVALID_ARGUMENT of
    a gRPC method, were never seen by rate() or increase(): their series appeared with them. A route's own status
    is known in advance and exported (a refusal's is not: it appears with the first); a route the service's role
    does not serve is not."""
    import grpc

    from leadtime.predictor.metrics import GRPC_METHODS

    with TestClient(create_app(ServiceSettings())) as c:
        text = c.get("/metrics").text
    for path, method, status in (
        ("/predict/bulk/strict", "POST", "200"),
        ("/v1/predict", "POST", "200"),
        ("/add_training_data_bulk", "POST", "202"),
        ("/v1/observations", "POST", "202"),
        ("/readyz", "HEAD", "200"),
        ("/metrics", "GET", "200"),
        ("/model/{name}/info", "GET", "200"),
    ):
        assert f'leadtime_http_requests_total{{method="{method}",path="{path}",status="{status}"}} 0.0' in text, path
        assert f'leadtime_http_request_duration_seconds_count{{path="{path}"}} 0.0' in text, path
    assert not re.search(r'leadtime_http_requests_total\{[^}]*status="[45]', text)
    for method in GRPC_METHODS:
        for code in grpc.StatusCode:
            assert f'leadtime_grpc_requests_total{{code="{code.name}",method="{method}"}} 0.0' in text, (method, code)
    with TestClient(create_app(ServiceSettings(role="training"))) as c:
        text = c.get("/metrics").text
    assert 'path="/add_training_data_bulk",status="202"} 0.0' in text
    assert 'path="/predict/bulk/strict"' not in text


def test_llmd_training_samples_count_leaves_the_held_out_test_samples_out_as_its_help_says() -> None:
    """It counted training and test samples together while its HELP (and llm-d's name) says training samples."""
    with TestClient(create_app(ServiceSettings())) as c:
        c.post("/add_training_data_bulk", json={"entries": [entry() for _ in range(60)]})
        status = c.get("/data/status").json()
        train, test = status["training_data"]["ttft_samples"], status["test_data"]["ttft_samples"]
        assert train and test, status  # some of the 60 were held out
        assert f'training_samples_count{{model="ttft"}} {train}\n' in c.get("/metrics").text


def test_each_app_has_its_own_metrics_registry() -> None:
    with TestClient(create_app(ServiceSettings())) as a, TestClient(create_app(ServiceSettings())) as b:
        a.post("/predict/bulk/strict", json={"requests": [row()]})
        assert 'leadtime_predictions_total{api="llmd"} 1.0' in a.get("/metrics").text
        assert 'leadtime_predictions_total{api="llmd"} 0.0' in b.get("/metrics").text


def test_the_docs_pages_load_their_assets_from_the_service_itself() -> None:
    # Regression: /docs loaded Swagger UI's JavaScript and CSS from a CDN, and was blank on an offline machine.
    import re

    with TestClient(create_app(ServiceSettings())) as client:
        for page in ("/docs", "/redoc"):
            html = client.get(page).text
            assets = re.findall(r'(?:src|href)="([^"]+)"', html)
            assert assets, page
            for url in assets:
                assert url.startswith("/docs/assets/"), (page, url)  # nothing from another host
                answer = client.get(url)
                assert answer.status_code == 200 and len(answer.content) > 100, url
        assert client.get("/openapi.json").status_code == 200
        metrics = client.get("/metrics").text
    assert 'path="/docs/assets"' in metrics
    assert 'path="unmatched"' not in metrics


def test_requests_that_match_no_route_are_counted_as_unmatched() -> None:
    with TestClient(create_app(ServiceSettings())) as client:
        assert client.get("/no/such/path").status_code == 404
        metrics = client.get("/metrics").text
    assert 'path="unmatched",status="404"' in metrics


def test_bodies_refused_before_routing_are_counted_under_their_route() -> None:
    """A 413 or 415 is answered before the app routes the request; the metrics still name the route it was for."""
    with TestClient(create_app(ServiceSettings(max_body_bytes=1_000))) as client:
        assert (
            client.post(
                "/predict/bulk/strict", content=b"x" * 2_000, headers={"content-type": "application/json"}
            ).status_code
            == 413
        )
        assert client.post("/predict/bulk", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
        assert client.post("/no/such/path", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
        metrics = client.get("/metrics").text
    assert 'path="/predict/bulk/strict",status="413"' in metrics
    assert 'path="/predict/bulk",status="415"' in metrics
    assert 'path="unmatched",status="415"' in metrics


def test_a_request_whose_handler_raises_is_counted_as_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    """The edge recorded a request only once the app returned: one whose route (or hot path) raised was answered
    500 by the error handler outside it and left out of `leadtime_http_requests_total`, so an error rate built on
    it read 0 while every such call failed."""
    app = create_app(ServiceSettings())

    def fail(*args: Any) -> None:
        raise RuntimeError("a bug")

    async def boom() -> None:
        fail()

    app.router.add_api_route("/boom", boom, methods=["GET"])
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/boom")
        assert answer.status_code == 500 and "a bug" in answer.json()["error"]
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        monkeypatch.setattr(runtime, "accept", fail)  # raises on the hot path, before any routing
        assert client.post("/add_training_data_bulk", json={"entries": [entry()]}).status_code == 500
        metrics = client.get("/metrics").text
    assert 'leadtime_http_requests_total{method="GET",path="/boom",status="500"} 1.0' in metrics
    assert 'leadtime_http_request_duration_seconds_count{path="/boom"} 1.0' in metrics
    assert 'leadtime_http_requests_total{method="POST",path="/add_training_data_bulk",status="500"} 1.0' in metrics


def test_on_port_0_the_log_says_which_port_the_system_picked(tmp_path: Path) -> None:
    """It logged "HTTP on http://127.0.0.1:0": a user could not tell where the service listened."""
    child = Child(["serve", "--port", "0", "--grpc-port", "0"], tmp_path / "serve.log")
    try:
        wait_for(lambda: "HTTP on http://" in child.output(), timeout_s=60)
        found = re.search(r"HTTP on http://127\.0\.0\.1:(\d+) ", child.output())
        assert found is not None and int(found[1]) > 0, child.output()
        url = f"http://127.0.0.1:{found[1]}"
        wait_for(lambda: _answers(url), timeout_s=30)
        assert httpx.get(f"{url}/healthz", timeout=5).json() == {"status": "ok"}
    finally:
        child.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_model_download_answers_304_to_any_if_none_match_that_names_it() -> None:
    """Only the exact quoted ETag got 304; HTTP compares If-None-Match weakly and `*` names any model."""
    with TestClient(create_app(ServiceSettings())) as c:
        etag = c.get("/v1/model").headers["etag"]
        for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            assert c.get("/v1/model", headers={"If-None-Match": header}).status_code == 304, header
        assert c.get("/v1/model", headers={"If-None-Match": '"other"'}).status_code == 200


def test_the_latency_histograms_resolve_calls_faster_than_half_a_millisecond() -> None:
    """The hot paths answer most calls in well under 0.5 ms on a quiet host; a histogram starting there put nearly
    all of them in its first bucket, and the dashboards' p50 and p99 were interpolations inside it. The buckets
    start at 0.1 ms and are no more than 2.5x apart up to 10 ms."""
    with TestClient(create_app(ServiceSettings())) as client:
        client.post("/predict/bulk/strict", json={"requests": [row()]})
        text = client.get("/metrics").text
    bucket = r'leadtime_http_request_duration_seconds_bucket\{le="([^"]+)",path="/predict/bulk/strict"\}'
    bounds = [float(le) for le in re.findall(bucket, text) if le != "+Inf"]
    assert bounds[0] <= 0.0001
    fine = [b for b in bounds if b <= 0.01]
    assert all(b / a <= 2.5 for a, b in itertools.pairwise(fine)), fine


def test_every_metric_family_has_help_text_llmds_lines_too() -> None:
    """promtool flagged llm-d's training-server lines (`model_type`, `ttft_importance`, ...) as having no HELP:
    each family carries HELP and TYPE lines, and its samples keep llm-d's names and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with TestClient(create_app(ServiceSettings())) as c:
        text = c.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    undocumented = sorted(name for name, f in families.items() if not f.documentation)
    assert not undocumented, undocumented
    for name in ("model_type", "ttft_importance", "training_samples_count", "ensemble_mode", "tpot_intercept"):
        assert families[name].type == "gauge", name
        assert f"# HELP {name} " in text
    assert 'model_type{type="lightgbm"} 1\n' in text and 'training_samples_count{model="ttft"} 0\n' in text


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("DELETE", "/flush", {}),  # no Content-Type: a write path's 415
        ("PUT", "/add_training_data_bulk", {"content-type": "text/plain"}),
        ("PATCH", "/predict/bulk/strict", {"content-type": "text/plain"}),
        ("POST", "/status", {"content-type": "text/plain"}),
        ("PUT", "/predict", {"content-type": "application/json", "content-encoding": "gzip"}),
    ],
)
def test_a_method_the_path_does_not_take_is_405_naming_the_ones_it_does(
    method: str, path: str, headers: dict[str, str]
) -> None:
    """An operator's `curl -X DELETE /flush` was told its Content-Type was wrong (415), and `PUT` with a text body
    the same: the edge judged the body before anything had said the path takes no such method. llm-d's server
    answers 405 with `Allow`; so does this, before any body is looked at. With a token configured, too: a method the
    path does not take changes nothing, so it needs no token to be told so."""
    with TestClient(create_app(ServiceSettings(grpc_port=0, api_token="s3cret"))) as client:
        answer = client.request(method, path, content=b"x", headers=headers)
    assert answer.status_code == 405, answer.text
    assert answer.headers["allow"], answer.headers
    assert answer.json()["error"] == "Method Not Allowed"


def test_a_method_the_path_does_not_take_is_405_even_with_a_body_over_the_limit() -> None:
    with TestClient(create_app(ServiceSettings(grpc_port=0, max_body_bytes=1_000))) as client:
        too_large = b" " * 2_000
        wrong = client.put("/predict/bulk/strict", content=too_large, headers={"content-type": "application/json"})
        right = client.post("/predict/bulk/strict", content=too_large, headers={"content-type": "application/json"})
    assert (wrong.status_code, right.status_code) == (405, 413), (wrong.text, right.text)


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/status", "/metrics"])
def test_a_405_on_a_probe_path_names_get_among_the_methods_it_takes(path: str) -> None:
    """These paths take HEAD beside GET (load balancers probe with it) through a route of its own, and a 405 named
    only that one (`Allow: HEAD`): an operator told to use HEAD for /status, /metrics."""
    with TestClient(create_app(ServiceSettings(grpc_port=0))) as client:
        answer = client.post(path, json={})
        assert answer.status_code == 405 and "GET" in answer.headers["allow"].split(", "), answer.headers
        assert client.head(path).status_code == 200 and client.get(path).status_code == 200
