"""Bad input to the gateway and to what configures it: requests, the plugin configuration, discovery files,
time-slice documents and `leadtime route`'s options. Each is refused with an error naming the problem (4xx with
the field, a ConfigError/DiscoveryError/TimesliceError, one `error:` line and exit code 2), never a 500 or a
traceback, and a file that turns bad while the gateway runs keeps what was read before it."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from leadtime.cli import app
from leadtime.router_plugin.config import ConfigError, build_policy, load_config, parse_config
from leadtime.router_plugin.discovery import (
    MAX_FILE_BYTES,
    DiscoveryError,
    FileDiscovery,
    StaticDiscovery,
    parse_endpoints,
    parse_static,
)
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.requests import BadRequest, parse_request
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.timeslice_sources import FileTimesliceSource, HttpTimesliceSource, TimesliceError

SHIPPED = Path(__file__).resolve().parents[1] / "router_plugin" / "plugins.yaml"
TTFT = "x-llm-d-slo-ttft-ms"
TPOT = "x-llm-d-slo-tpot-ms"


# ----- requests through the gateway (in process, no endpoint needed: they are refused before routing) --------


def gateway() -> Gateway:
    return Gateway(StaticDiscovery(()), RoundRobinPolicy(), GatewaySettings(timeslice_poll_s=0.001))


def post(
    path: str, body: bytes, headers: list[tuple[str, str]] | None = None, app: Gateway | None = None
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app or gateway(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post(path, content=body, headers=headers or [])

    return asyncio.run(go())


@pytest.mark.parametrize("ids", [[2**31], [1, 2**32], [2**64 - 1], [-1], [[5], [2**40]]])
def test_token_ids_outside_a_vocabulary_are_422_naming_the_prompt(ids: list[object]) -> None:
    response = post("/v1/completions", json.dumps({"prompt": ids, "max_tokens": 4}).encode())
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "prompt" and "token ids" in response.json()["error"]["message"]


@pytest.mark.parametrize("header", [TTFT, TPOT])
def test_an_slo_header_given_twice_is_422_naming_it(header: str) -> None:
    response = post("/v1/completions", b'{"prompt": "hi"}', [(header, "100"), (header, "2000")])
    assert response.status_code == 422 and response.json()["error"]["param"] == header
    assert "100, 2000" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "value,shown",
    [("9" * 20_000, "got a 20,000-digit number"), ("x" * 20_000, "got 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'…")],
)
def test_a_long_slo_header_is_not_echoed_whole(value: str, shown: str) -> None:
    """A 20,000-digit `x-llm-d-slo-ttft-ms` came back whole in the 422's message (20 KB)."""
    response = post("/v1/completions", b'{"prompt": "hi"}', [(TTFT, value)])
    message = response.json()["error"]["message"]
    assert response.status_code == 422 and response.json()["error"]["param"] == TTFT
    assert shown in message and len(message) < 200, message


@pytest.mark.parametrize("header", [TTFT, TPOT])
@pytest.mark.parametrize("value", ["1e-320", "1e-300", "0.0009"])
def test_an_slo_header_below_a_microsecond_is_422_naming_it(header: str, value: str) -> None:
    """`x-llm-d-slo-tpot-ms: 1e-320` was routed: its 1 / SLO, infinite, stayed in the in-flight ledger of its
    endpoint as NaN once it completed, and every later decision offered that endpoint raised IndexError
    (`policy_error` fallbacks, a traceback each) while anything was in flight there."""
    response = post("/v1/completions", b'{"prompt": "hi"}', [(header, value)])
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == header
    assert "0.001" in response.json()["error"]["message"] and value in response.json()["error"]["message"]


@pytest.mark.parametrize("value", ["1_000", "1_0.5", "0x10", "1e"])
def test_an_slo_header_written_as_no_plain_decimal_is_422_naming_it(value: str) -> None:
    """Python's float() takes `1_000`, which Go's strconv.ParseFloat (llm-d's router is Go) refuses: a header
    llm-d turns away routed here with an SLO."""
    response = post("/v1/completions", b'{"prompt": "hi"}', [(TTFT, value)])
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == TTFT


@pytest.mark.parametrize(("value", "slo"), [("100", 100.0), (" 2.5e3 ", 2500.0), ("+7", 7.0), ("0.5", 0.5)])
def test_an_slo_header_of_a_decimal_number_is_taken(value: str, slo: float) -> None:
    parsed = parse_request("/v1/completions", b'{"prompt": "hi"}', {TTFT.encode(): value.encode()})
    assert parsed.ttft_slo_ms == slo


def test_an_slo_header_of_a_microsecond_is_taken() -> None:
    parsed = parse_request("/v1/completions", b'{"prompt": "hi"}', {TTFT.encode(): b"0.001", TPOT.encode(): b"0.001"})
    assert (parsed.ttft_slo_ms, parsed.tpot_slo_ms) == (0.001, 0.001)


def test_the_picks_counters_help_says_a_pd_request_counts_twice() -> None:
    """It said "Routing decisions", while on P/D a request counts on its prefill and on its decode endpoint."""
    from leadtime.router_plugin.gateway.metrics import GatewayMetrics

    text = GatewayMetrics().render().decode()
    help_line = next(line for line in text.splitlines() if line.startswith("# HELP leadtime_router_picks_total"))
    assert "prefill" in help_line and "decode" in help_line, help_line


@pytest.mark.parametrize("model", [False, 0, [], {}, 5])
def test_a_model_that_is_not_a_string_is_422(model: object) -> None:
    with pytest.raises(BadRequest) as err:
        parse_request("/v1/completions", json.dumps({"prompt": "hi", "model": model}).encode(), {})
    assert (err.value.status, err.value.field) == (422, "model")


GZIPPED = gzip.compress(b'{"prompt": "x"}', mtime=0)


@pytest.mark.parametrize(
    "path,body,headers,status,field",
    [
        ("/v1/completions", b"", [], 400, "body"),
        ("/v1/completions", b'{"prompt": "\\ud800"}', [], 400, "body"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", [], 400, "body"),
        ("/v1/completions", b'{"prompt": [1e400]}', [], 400, "body"),
        ("/v1/completions", b"null", [], 422, "body"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', [], 422, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', [], 422, "stream"),
        ("/v1/chat/completions", b'{"messages": [null]}', [], 422, "messages[0]"),
        ("/v1/completions", b'{"prompt": "x"}', [(TTFT, "1e400")], 422, TTFT),
        ("/v1/completions", b'{"prompt": "x"}', [(TPOT, "-0")], 422, TPOT),
        ("/v1/completions", b'{"prompt": "x"}', [(TTFT, "")], 422, TTFT),
        ("/v1/completions", GZIPPED, [("content-encoding", "gzip")], 415, "content-encoding"),
    ],
)
def test_bad_requests_through_the_gateway_are_4xx_naming_the_field(
    path: str, body: bytes, headers: list[tuple[str, str]], status: int, field: str
) -> None:
    response = post(path, body, headers)
    assert response.status_code == status and response.json()["error"]["param"] == field
    # The shape OpenAI clients read (they showed "Error code: 422" alone, the gateway's message lost).
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["message"].startswith(f"{field}: ") and error["type"].endswith("Error")


def test_unknown_paths_and_methods_are_404_counted_as_unmatched() -> None:
    """Counted as the predictor counts its own 404s: under one path label, not one series per path scanned."""

    async def go() -> tuple[list[int], str]:
        transport = httpx.ASGITransport(app=gateway(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            codes = [
                (await client.request(method, path)).status_code
                for method, path in (("GET", "/v1/completions"), ("POST", "/metrics"), ("GET", "/nope"))
            ]
            return codes, (await client.get("/metrics")).text

    codes, metrics = asyncio.run(go())
    assert codes == [404, 404, 404]
    assert 'leadtime_router_requests_total{code="404",path="unmatched"} 3.0' in metrics
    assert 'path="/nope"' not in metrics


def test_probes_answer_head_with_no_body() -> None:
    """Load balancers and `curl -I` probe with HEAD: GET's status and headers, no body."""

    async def go() -> list[tuple[int, bytes]]:
        transport = httpx.ASGITransport(app=gateway(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return [((r := await client.head(path)).status_code, r.content) for path in ("/healthz", "/metrics")]

    assert asyncio.run(go()) == [(200, b""), (200, b"")]


def test_with_api_keys_the_api_paths_need_one_and_health_and_metrics_stay_open() -> None:
    keyed = Gateway(StaticDiscovery(()), RoundRobinPolicy(), GatewaySettings(api_keys=("k-old", "k-new")))
    body = b'{"prompt": "x"}'
    for headers in ([], [("authorization", "Bearer wrong")], [("authorization", "Basic k-new")]):
        refused = post("/v1/completions", body, headers, app=keyed)
        assert refused.status_code == 401 and refused.json()["error"]["param"] == "authorization", headers
        assert refused.headers["www-authenticate"] == "Bearer"
    assert post("/tokenize", body, [], app=keyed).status_code == 401
    for key in ("k-old", "k-new"):  # either key passes; no endpoint here, so the answer is the 503 that follows
        assert post("/v1/completions", body, [("authorization", f"Bearer {key}")], app=keyed).status_code == 503

    async def open_paths() -> list[int]:
        transport = httpx.ASGITransport(app=keyed, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return [(await client.get(path)).status_code for path in ("/healthz", "/metrics", "/v1/models")]

    assert asyncio.run(open_paths()) == [200, 200, 401]


def test_with_allowed_hosts_another_host_is_400_before_the_key_and_probes_stay_open() -> None:
    """DNS rebinding: a page whose name resolves to the gateway reaches it as same-origin, with its own Host. With
    --allowed-host it is refused before the key is checked or the body read; probes and /metrics answer any Host."""
    settings = GatewaySettings(allowed_hosts=("gateway", "*.example.com"), api_keys=("k",))
    listed = Gateway(StaticDiscovery(()), RoundRobinPolicy(), settings)
    body, key = b'{"prompt": "x"}', ("authorization", "Bearer k")
    for headers in ([("host", "evil.example"), key], [("host", "evil.example")], [("host", "x" * 20_000), key]):
        refused = post("/v1/completions", body, headers, app=listed)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "host" and error["type"] == "BadRequestError" and len(error["message"]) < 120
    assert (
        "Host 'evil.example' is not an allowed host (--allowed-host)"
        in post("/tokenize", body, [("host", "evil.example")], app=listed).json()["error"]["message"]
    )
    # Allowed: on to the routing, which with no endpoint here answers 503.
    assert post("/v1/completions", body, [key], app=listed).status_code == 503  # base_url's host is "gateway"
    assert post("/v1/completions", body, [("host", "a.example.com:8080"), key], app=listed).status_code == 503

    async def probes(host: str) -> list[int]:
        transport = httpx.ASGITransport(app=listed, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            paths = ("/healthz", "/readyz", "/metrics", "/v1/models")
            return [
                (await client.get(path, headers={"host": host, "authorization": "Bearer k"})).status_code
                for path in paths
            ]

    assert asyncio.run(probes("10.1.2.3:8080")) == [200, 503, 200, 400]  # /readyz: no endpoint here
    assert 'leadtime_router_requests_total{code="400",path="/v1/completions"} 3.0' in listed._render_metrics().decode()


def test_with_allowed_hosts_a_request_with_no_host_is_refused() -> None:
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    listed = Gateway(StaticDiscovery(()), RoundRobinPolicy(), GatewaySettings(allowed_hosts=("gateway",)))
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [], "query_string": b""}
    asyncio.run(listed(scope, receive, send))
    assert sent[0]["status"] == 400 and "no Host header" in json.loads(sent[1]["body"])["error"]["message"]
    sent.clear()
    asyncio.run(gateway()(scope, receive, send))  # no list: answered as before (no endpoint here: 503)
    assert sent[0]["status"] == 503


def test_an_endpoint_discovery_dropped_leaves_the_per_endpoint_gauges() -> None:
    """A removed endpoint read as routable, its scrape age frozen, on every scrape after."""
    from leadtime.router_plugin.gateway.upstream import UpstreamError
    from leadtime.router_plugin.scrape import EndpointScrape

    app = gateway()
    (endpoint,) = parse_static(["127.0.0.1:9,name=gone"])
    app.scraper.scrapes["gone"] = EndpointScrape(endpoint)
    app._failed("gone", UpstreamError("timeout", "no data"), 0.0)  # its counters too: pods come and go by name
    app._answered("gone", 500, 0.0)
    assert 'leadtime_router_endpoint_routable{endpoint="gone"}' in app._render_metrics().decode()
    del app.scraper.scrapes["gone"]
    assert 'endpoint="gone"' not in app._render_metrics().decode()


def test_with_no_endpoint_discovered_readiness_and_requests_say_so() -> None:
    async def go() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=gateway(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/readyz"), await client.post("/v1/completions", json={"prompt": "x"})

    ready, reply = asyncio.run(go())
    assert ready.status_code == 503 and ready.json()["reason"] == "discovery lists no endpoint"
    assert reply.status_code == 503 and reply.json()["error"]["message"].endswith(": discovery lists no endpoint")
    assert reply.headers["retry-after"] == "1"  # as clients that retry read a 503


def test_model_listings_are_counted_as_the_requests_they_are() -> None:
    """GET /v1/models (every openai client's models.list()) was missing from leadtime_router_requests_total."""
    app = gateway()

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/v1/models")

    assert asyncio.run(go()).status_code == 503  # no endpoint to ask
    assert 'leadtime_router_requests_total{code="503",path="/v1/models"} 1.0' in app._render_metrics().decode()


def test_a_path_passed_through_with_no_endpoint_to_serve_it_is_503() -> None:
    reply = post("/tokenize", b'{"prompt": "anyone?"}', [])
    assert reply.status_code == 503 and reply.json()["error"]["param"] == "endpoints"


# ----- the plugin configuration ------------------------------------------------------------------------------


def shipped() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())
    return data


@pytest.mark.parametrize(
    "content,problem",
    [(b"\xff\xfe plugins: []", "not UTF-8 text"), (b"[" * 20_000, "nested too deeply"), (b"seed: " + b"9" * 5000, "")],
)
def test_a_config_file_that_cannot_be_read_as_yaml_is_a_config_error(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"bad.yaml: .*{problem}"):
        load_config(path)


def test_a_parameter_mistake_names_the_file_and_the_plugin_whichever_profile_is_used(tmp_path: Path) -> None:
    data = shipped()
    data["plugins"][2]["parameters"]["exploration"] = 2
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: plugins\[2\]\.parameters\.exploration: .*less than or equal to 1"
    ):
        load_config(path)


@pytest.mark.parametrize("plugin", ["queue-scorer", "kv-cache-utilization-scorer", "max-score-picker"])
def test_parameters_given_to_a_plugin_that_takes_none_are_refused(plugin: str) -> None:
    data = shipped()
    index = next(i for i, p in enumerate(data["plugins"]) if p["type"] == plugin)
    data["plugins"][index]["parameters"] = {"maxScore": 3}
    with pytest.raises(ConfigError, match=rf"plugins\[{index}\]\.parameters: {plugin} takes no parameters"):
        parse_config(data)


def test_llm_ds_own_prefix_scorer_and_picker_parameters_still_load() -> None:
    """A config copied from llm-d sets these; refusing them would break the drop-in promise."""
    data = shipped()
    for plugin in data["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin["parameters"] = {"hashBlockSize": 64, "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": 31250}
        if plugin["type"] == "max-score-picker":
            plugin["parameters"] = {"maxNumOfEndpoints": 1}
    parse_config(data)
    index = next(i for i, p in enumerate(data["plugins"]) if p["type"] == "prefix-cache-scorer")
    data["plugins"][index]["parameters"]["blockSize"] = 64
    refused = r"prefix-cache-scorer takes no parameters \(llm-d's hashBlockSize.*got \['blockSize'\]"
    with pytest.raises(ConfigError, match=refused):
        parse_config(data)


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda d: d["schedulingProfiles"][1]["plugins"][1].update(weight=float("inf")), "weight"),
        (lambda d: d["fallback"]["weights"].update({"queue-scorer": -2}), "fallback.weights.queue-scorer"),
        (lambda d: d["fallback"]["weights"].update({"queue-scorer": float("inf")}), "fallback.weights.queue-scorer"),
        (lambda d: d["fallback"]["weights"].update({"queue-scorer": float("nan")}), "fallback.weights.queue-scorer"),
        (lambda d: d["fallback"].update(deadlineMs=float("inf")), "fallback.deadlineMs"),
        (lambda d: d["fallback"].update(deadlineMs=1e300), "fallback.deadlineMs"),
        (lambda d: d["schedulingProfiles"].append({**d["schedulingProfiles"][1], "name": "default"}), "default"),
    ],
)
def test_weights_deadlines_and_profiles_that_cannot_work_are_refused(
    change: Callable[[dict[str, Any]], None], field: str
) -> None:
    data = shipped()
    change(data)
    with pytest.raises(ConfigError, match=field):
        build_policy(parse_config(data), None, profile="heuristic")


# ----- discovery ---------------------------------------------------------------------------------------------


def endpoints(**change: object) -> dict[str, object]:
    return {"endpoints": [{"name": "a", "address": "10.0.0.1", "port": "8000", **change}]}


@pytest.mark.parametrize(
    "data,field",
    [
        (endpoints(labels={"leadtime.io/tensor-parallel": "²"}), "endpoints[0].labels.leadtime.io/tensor-parallel"),
        (endpoints(labels={"leadtime.io/tensor-parallel": "9" * 5000}), "endpoints[0].labels.leadtime.io/tensor"),
        (endpoints(labels={"leadtime.io/tensor-parallel": "9" * 20}), "endpoints[0].labels.leadtime.io/tensor"),
        (endpoints(name="x" * 300), "endpoints[0].name"),
        (endpoints(port=True), "endpoints[0].port"),
        (endpoints(port="8_0"), "endpoints[0].port"),
        (endpoints(address="   "), "endpoints[0].address"),
        (endpoints(address="not a host!"), "endpoints[0].address"),
        # an address written with its port: accepted, a reload took it over the endpoint's good address, and every
        # scrape failed ("connect: 10.0.0.7:8000:8000: Name or service not known")
        (endpoints(address="10.0.0.7:8000"), "endpoints[0].address: must be a host name or an IP address"),
        (endpoints(address="vllm-0.serving:8000"), "endpoints[0].address: must be a host name or an IP address"),
        (endpoints(address="[::1]:8000"), "endpoints[0].address: must be a host name or an IP address"),
        (  # Leadtime's own label namespace: a misspelling left the endpoint taken as an H100, silently
            endpoints(labels={"leadtime.io/accelarator": "l40s"}),
            "endpoints[0].labels.leadtime.io/accelarator: not a Leadtime label (known: leadtime.io/accelerator",
        ),
    ],
)
def test_discovery_refuses_what_no_endpoint_can_be(data: dict[str, object], field: str) -> None:
    with pytest.raises(DiscoveryError) as err:
        parse_endpoints(data)
    assert str(err.value).startswith(field)


def test_an_ipv6_address_in_brackets_is_read_as_the_address() -> None:
    """ "[::1]" was kept with its brackets and the endpoint named "[[::1]]:8000": never reached."""
    (endpoint,) = parse_endpoints(endpoints(address="[::1]"))
    assert endpoint.address == "::1" and endpoint.host_port == "[::1]:8000"


def test_a_static_endpoint_with_a_bad_tensor_parallel_label_is_a_discovery_error() -> None:
    with pytest.raises(DiscoveryError, match="tensor-parallel"):
        parse_static(["127.0.0.1:8000,leadtime.io/tensor-parallel=²"])


@pytest.mark.parametrize("content", [b"[" * 20_000, b"endpoints: " + b"9" * 5000, b"{a: " * 5000])
def test_a_discovery_file_nested_too_deep_is_refused_at_start_and_kept_out_on_reload(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_bytes(content)
    with pytest.raises(DiscoveryError, match="endpoints.yaml"):
        FileDiscovery(path)
    path.write_text(json.dumps(endpoints()))
    discovery = FileDiscovery(path)
    new = tmp_path / "new"
    new.write_bytes(content)
    new.replace(path)
    assert discovery.poll() is False
    assert [e.endpoint_id for e in discovery.endpoints] == ["a"]
    assert discovery.failed_reloads == 1 and "endpoints.yaml" in (discovery.last_error or "")


# ----- time-slice states ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe", b"[" * 20_000, b'{"groups": {"rl": {"state": "LOCKED", "waiters": ' + b"9" * 5000 + b"}}}"],
)
def test_a_broken_timeslice_file_keeps_the_previous_states(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "groups.json"
    path.write_text('{"groups": {"rl": {"state": "LOCKED", "active_job": "training"}}}')
    source = FileTimesliceSource(path, lambda: 1000.0)
    source.poll()
    new = tmp_path / "new"
    new.write_bytes(content)
    new.replace(path)
    source.poll()
    assert source.errors == 1 and "groups.json" in (source.last_error or "")
    status = source.status("rl")
    assert status is not None and status.state == "LOCKED"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "the document is empty"),
        (b"[1, 2]", "document: must be a mapping with 'groups', got a list"),
        (b"just text", "document: must be a mapping with 'groups', got a string"),
        (b'{"groups": {"rl": {"state": "LOCKED", "since": NaN}}}', "groups.rl.since: Input should be a finite number"),
    ],
)
def test_a_timeslice_document_of_the_wrong_shape_says_what_it_is(tmp_path: Path, content: bytes, said: str) -> None:
    """A list or an empty file was `document: Input should be a valid dictionary or instance of _Document` (a class
    of ours), a NaN `since` "greater than or equal to 0"."""
    path = tmp_path / "groups.json"
    path.write_bytes(content)
    source = FileTimesliceSource(path, lambda: 1000.0)
    source.poll()
    assert source.errors == 1 and said in (source.last_error or ""), source.last_error
    assert "_Document" not in (source.last_error or "")


def test_a_timeslice_file_larger_than_a_discovery_file_may_be_is_not_read(tmp_path: Path) -> None:
    """It was read whole, however large (discovery stops at 1 MiB): a file filled by mistake took the router's
    memory and a poll's time."""
    path = tmp_path / "groups.json"
    path.write_text('{"groups": {"rl": {"state": "LOCKED"}}, "pad": "' + "x" * (MAX_FILE_BYTES + 10) + '"}')
    source = FileTimesliceSource(path, lambda: 1000.0)
    source.poll()
    assert source.errors == 1 and "larger than 1 MiB" in (source.last_error or ""), source.last_error
    assert source.status("rl") is None


@pytest.mark.parametrize(
    "url", ["http://orchestrator:99999/groups", "http://orchestrator:x/", "http://[::1/", "ftp://orchestrator/"]
)
def test_a_timeslice_url_that_cannot_be_used_is_a_timeslice_error(url: str) -> None:
    with pytest.raises(TimesliceError, match=r"expected http\(s\)://HOST\[:PORT\]/PATH"):
        HttpTimesliceSource(url, gateway().upstreams, lambda: 0.0)


@pytest.mark.parametrize(
    "url", ["http://orch:s3cret@127.0.0.1:8090/groups", "http://:s3cret@127.0.0.1:99999/groups", "https://s3cret@o/"]
)
def test_a_timeslice_url_holding_credentials_is_refused_without_showing_them(url: str) -> None:
    """A user and password in --timeslice-url were never sent (the states are read without any), and the URL, as
    given, was in every log line and in /readyz, which answers anyone: the password with it."""
    with pytest.raises(TimesliceError) as err:
        HttpTimesliceSource(url, gateway().upstreams, lambda: 0.0)
    assert "is not sent" in str(err.value) and "s3cret" not in str(err.value), err.value
    code, output = route("--endpoint", "127.0.0.1:1", "--profile", "heuristic", "--timeslice-url", url)
    assert code == 2 and output.startswith("error: --timeslice-url: ") and "s3cret" not in output, output


def test_a_timeslice_url_may_be_https() -> None:
    """An orchestrator behind TLS was refused as not http://; it is verified as the endpoints are (--upstream-ca
    or the system's CAs)."""
    source = HttpTimesliceSource("https://orchestrator/v1/groups", gateway().upstreams, lambda: 0.0)
    assert (source.host, source.port, source.tls, source.path) == ("orchestrator", 443, True, "/v1/groups")


def test_the_timeslice_watcher_keeps_watching_after_a_source_fails() -> None:
    class Exploding:
        errors = 0

        def __init__(self) -> None:
            self.polls = 0

        def poll(self) -> None:
            self.polls += 1
            raise RuntimeError("boom")

        def status(self, group: str) -> None:
            return None

    source = Exploding()
    app = gateway()
    app.timeslice = source

    async def watch() -> None:
        task = asyncio.get_running_loop().create_task(app._watch_timeslice())
        await asyncio.sleep(0.05)
        assert not task.done(), task
        task.cancel()

    asyncio.run(watch())
    assert source.polls > 1


def test_failed_timeslice_reads_are_a_counter(tmp_path: Path) -> None:
    """The failed reads were exported as a gauge holding a running count (no `_total`, no `rate()`)."""
    path = tmp_path / "groups.json"
    path.write_text("{not json")
    app = gateway()
    app.timeslice = FileTimesliceSource(path, lambda: 1000.0)

    async def watch() -> str:
        task = asyncio.get_running_loop().create_task(app._watch_timeslice())
        await asyncio.sleep(0.05)
        task.cancel()
        return app._render_metrics().decode()

    text = asyncio.run(watch())
    assert "# TYPE leadtime_router_timeslice_source_errors_total counter" in text
    failed = re.search(r"^leadtime_router_timeslice_source_errors_total (\S+)$", text, re.M)
    assert failed is not None and float(failed.group(1)) == app.timeslice.errors >= 1


def test_the_pulled_model_age_is_minus_one_without_a_pulled_model() -> None:
    """Its help says -1 before any pull reached the model; without --pull-model it read 0, a model just pulled."""
    text = gateway()._render_metrics().decode()
    assert re.search(r"^leadtime_router_pulled_model_age_seconds -1\.0$", text, re.M), text


# ----- leadtime route ------------------------------------------------------------------------------------------


def route(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["route", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ttft-slo-ms", "nan"], "--ttft-slo-ms"),
        (["--tpot-slo-ms", "inf"], "--tpot-slo-ms"),
        (["--ttft-slo-ms", "1e-320"], "--ttft-slo-ms must be at least 0.001"),
        (["--tpot-slo-ms", "0.0001"], "--tpot-slo-ms must be at least 0.001"),
        (["--scrape-interval-ms", "nan"], "--scrape-interval-ms"),
        (["--scrape-interval-ms", "inf"], "--scrape-interval-ms"),
        (["--unroutable-after-s", "nan"], "--unroutable-after-s"),
        (["--pull-interval-s", "nan"], "--pull-interval-s"),
        (["--timeslice-url", "http://orchestrator:99999/"], "--timeslice-url: 'http://orchestrator:99999/'"),
        (["--api-token", "secret\r\nX-Injected: 1"], "--api-token"),
        (["--timeslice-file", "states.json", "--timeslice-url", "http://orchestrator:9/"], "alternatives: give one"),
        (["--port", "0"], "--port must be between 1 and 65535"),
        (["--port", "65536"], "--port must be between 1 and 65535"),
        (["--predictor-grpc", "nohost"], "--predictor-grpc: expected HOST:PORT (a port from 1 to 65535), got 'nohost'"),
        (["--predictor-grpc", ":5"], "--predictor-grpc: expected HOST:PORT (a port from 1 to 65535), got ':5'"),
        (["--allowed-host", ""], "--allowed-host: an entry is empty"),
        (["--allowed-host", "gateway:8080"], "--allowed-host: 'gateway:8080' has a port: give the host without it"),
        (["--allowed-host", "https://gateway"], "without scheme or path"),
        (["--allowed-host", "gate way"], "--allowed-host: 'gate way' has spaces"),
    ],
)
def test_route_refuses_options_that_cannot_work_with_one_line(args: list[str], message: str) -> None:
    policy = ["--profile", "heuristic"] if "--timeslice-url" in args else ["--policy", "random"]  # one that reads it
    if "--predictor-grpc" in args:
        policy = []  # the predictor is one to route on
    code, output = route("--endpoint", "127.0.0.1:1", *policy, *args)
    assert code == 2, output
    assert output.startswith("error: ") and message in output and "Traceback" not in output


def test_route_refuses_config_and_discovery_files_it_cannot_use_naming_them(tmp_path: Path) -> None:
    config = tmp_path / "plugins.yaml"
    config.write_bytes(b"\xff\xfe")
    code, output = route("--endpoint", "127.0.0.1:1", "--embedded", "--config", str(config))
    assert code == 2 and "plugins.yaml: not UTF-8 text" in output and "Traceback" not in output
    discovery = tmp_path / "endpoints.yaml"
    discovery.write_text(yaml.safe_dump(endpoints(labels={"leadtime.io/tensor-parallel": "²"})))
    code, output = route("--discovery", str(discovery), "--policy", "random")
    assert code == 2 and "endpoints.yaml: endpoints[0].labels.leadtime.io/tensor-parallel" in output


@pytest.mark.parametrize("content", [b"[1, 2]", b"groups: {rl: {state: ASLEEP}}"])
def test_route_refuses_a_timeslice_file_it_cannot_read_at_start(
    tmp_path: Path, content: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --timeslice-file of the wrong shape started the gateway with a warning and no states: every group was
    taken as serving, traffic went to endpoints that were training (a discovery file that cannot be read stops it).
    One not there yet is waited for (`test_groups_are_taken_as_away_until_their_states_are_first_read`)."""
    from leadtime.router_plugin.gateway import serve

    monkeypatch.setattr(serve, "serve_gateway", lambda *a, **k: pytest.fail("the gateway was started"))
    states = tmp_path / "groups.yaml"
    states.write_bytes(content)
    code, output = route("--endpoint", "127.0.0.1:1", "--embedded", "--timeslice-file", str(states))
    assert code == 2 and output.startswith("error: --timeslice-file: ") and "groups.yaml" in output, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output


def test_groups_are_taken_as_away_until_their_states_are_first_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file an orchestrator's sidecar has not written yet (they start together in one pod) must not stop the
    gateway (a crash loop), nor route into a training job's turn: until the states are first read, every group is
    taken as away."""
    from leadtime.router_plugin.gateway import serve

    started: list[object] = []
    monkeypatch.setattr(serve, "serve_gateway", lambda *a, **k: started.append(a))
    path = tmp_path / "groups.yaml"
    with caplog.at_level(logging.WARNING):
        code, output = route("--endpoint", "127.0.0.1:1", "--embedded", "--timeslice-file", str(path))
    assert code == 0 and len(started) == 1, output
    assert any("none read yet: every group is taken as away" in r.getMessage() for r in caplog.records), caplog.text
    (endpoint,) = parse_static(["127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl"])
    gateway = Gateway(StaticDiscovery((endpoint,)), RoundRobinPolicy(), GatewaySettings())
    gateway.timeslice = FileTimesliceSource(path, lambda: 1000.0)
    gateway.timeslice.first_read()
    assert gateway._group_state("rl") == "parked"
    path.write_text("groups: {rl: {state: LOCKED, active_job: inference, loaded_job: inference}}\n")
    gateway.timeslice.poll()
    assert gateway._group_state("rl") == "resident"


def route_refused(*args: str) -> list[str]:
    """`leadtime route` with `args` (and an endpoint, a policy): exit status 2 and the lines on stderr."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "leadtime", "route", "--endpoint", "127.0.0.1:1", "--policy", "random", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 60
    return result.stderr.strip().splitlines()


def test_route_on_a_port_in_use_says_so_in_one_line_as_serve_and_sim_serve_do() -> None:
    """Regression: `serve` and `sim serve` said `error: cannot serve HTTP on HOST:PORT: ...`, route only
    `error: HOST:PORT: ...`."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        lines = route_refused("--port", str(port))
    assert lines == [f"error: cannot serve the gateway on 127.0.0.1:{port}: address already in use"]


def test_route_on_a_host_it_cannot_resolve_says_so_in_one_line() -> None:
    [line] = route_refused("--host", "999.1.1.1", "--port", "47801")
    assert line.startswith("error: cannot serve the gateway on 999.1.1.1:47801: ") and "resolved" in line


@pytest.mark.parametrize(
    "specs,message",
    [
        (["127.0.0.1:8000,name="], "endpoint 1 ('127.0.0.1:8000,name='): name: "),
        (
            ["127.0.0.1:8000,name=a", "127.0.0.1:8000,name=b"],
            "endpoint 2 ('127.0.0.1:8000,name=b'): address: 127.0.0.1:8000 is endpoint 'a' already",
        ),
        (
            ["127.0.0.1:8000,llm-d.ai/role=Decode"],
            "endpoint 1 ('127.0.0.1:8000,llm-d.ai/role=Decode'): llm-d.ai/role: ",
        ),
        (["host:80:90"], "endpoint 1 ('host:80:90'): address: must be a host name or an IP address"),
    ],
)
def test_a_static_endpoint_refused_is_named_as_given(specs: list[str], message: str) -> None:
    """An --endpoint refused was named as an entry of a list nobody wrote ("endpoints[0].name: ...")."""
    with pytest.raises(DiscoveryError) as err:
        parse_static(specs)
    assert str(err.value).startswith(message), err.value


def _without_hanging(read: Callable[[], object], fifo: Path) -> object:
    """`read()`'s result or exception, in a thread given 5 s: a reader blocked opening the named pipe `fifo` is let go
    (a writer opens it) so that the test ends either way."""
    import threading

    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(read())
        except Exception as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader waiting on it opens, reads nothing
        thread.join(5)
        pytest.fail("reading a named pipe blocked until something wrote to it")
    return outcome[0]


def test_a_named_pipe_as_the_discovery_or_time_slice_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A named pipe where the files are read was opened and read until something wrote to it: a gateway given one
    never started and said nothing, one whose discovery file became one stopped re-reading it, and one whose
    time-slice file became one froze (that file is read on the event loop) until killed."""
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    refused = _without_hanging(lambda: FileDiscovery(fifo), fifo)
    assert isinstance(refused, DiscoveryError) and "pipe.yaml: not a regular file" in str(refused), refused

    path = tmp_path / "endpoints.yaml"
    path.write_text(json.dumps(endpoints()))
    discovery = FileDiscovery(path)
    path.unlink()
    os.mkfifo(path)
    assert _without_hanging(discovery.poll, path) is False
    assert [e.endpoint_id for e in discovery.endpoints] == ["a"]
    assert "endpoints.yaml: not a regular file" in (discovery.last_error or "")

    source = FileTimesliceSource(fifo, lambda: 0.0)
    refused = _without_hanging(source.first_read, fifo)
    assert isinstance(refused, TimesliceError) and "pipe.yaml: not a regular file" in str(refused), refused
    states = tmp_path / "groups.yaml"
    states.write_text("groups: {rl: {state: LOCKED, active_job: inference, loaded_job: inference}}\n")
    source = FileTimesliceSource(states, lambda: 0.0)
    source.first_read()
    states.unlink()
    os.mkfifo(states)
    _without_hanging(source.poll, states)
    assert source.status("rl") is not None and "groups.yaml: not a regular file" in (source.last_error or "")


def test_a_key_given_twice_in_json_is_refused_as_in_yaml(tmp_path: Path) -> None:
    """YAML's loader refuses a key given twice, but a JSON discovery file or time-slice document kept the last one
    silently: a second "endpoints" list dropped every endpoint of the first, a group given twice took its second
    state."""
    path = tmp_path / "endpoints.json"
    first = endpoints()["endpoints"]
    path.write_text('{"endpoints": ' + json.dumps(first) + ', "endpoints": []}')
    with pytest.raises(
        DiscoveryError, match=r"endpoints.json: not valid YAML/JSON \(the key 'endpoints' is given twice"
    ):
        FileDiscovery(path)
    states = tmp_path / "groups.json"
    states.write_text(
        '{"groups": {"rl": {"state": "LOCKED", "active_job": "inference", "loaded_job": "inference"},'
        ' "rl": {"state": "IDLE"}}}'
    )
    source = FileTimesliceSource(states, lambda: 0.0)
    with pytest.raises(TimesliceError, match="the key 'rl' is given twice"):
        source.first_read()
