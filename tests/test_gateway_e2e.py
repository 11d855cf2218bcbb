"""`leadtime route` end to end, every part a real process on loopback: `leadtime sim serve` endpoints, `leadtime
serve` as the predictor, the gateway itself; plus, where a test must stop an endpoint or slow the predictor down,
a server of its own in this process."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from waiting import wait_for

from leadtime.bench.procs import Predictor, Route, SimFleet, free_port
from leadtime.router_plugin.gateway.metrics import FALLBACK_REASONS
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.serve import FleetServer

FLEET = {
    "name": "two-classes",
    "pools": [
        {"name": "h100", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
        {"name": "l40s", "count": 1, "accelerator": "l40s", "model": "llama-3.1-8b"},
    ],
}
JSON = {"content-type": "application/json"}


def stream_request(url: str, prompt: str, max_tokens: int, **headers: str) -> tuple[httpx.Response, list[str]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={**JSON, **headers}, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return response, events


def token_events(events: list[str]) -> list[dict[str, object]]:
    """The events that carry a token (not the role's, the finish reason's or the usage's)."""
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return [c for c in chunks if c.get("choices") and c["choices"][0].get("text")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[tuple[SimFleet, Predictor, Route, Path]]:
    """Two endpoints (H100, L40S), the predictor service, and a gateway routing with Leadtime over HTTP."""
    fleet_file = workdir / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    predictor = Predictor(workdir)
    fleet = SimFleet(fleet_file, workdir)
    discovery = workdir / "discovery.yaml"
    shutil.copy(fleet.endpoints_file, discovery)
    predictor.wait()
    route = Route(workdir, ["--discovery", str(discovery), "--predictor-url", predictor.url])
    try:
        route.wait()
        yield fleet, predictor, route, discovery
    finally:
        route.child.stop()
        predictor.child.stop()
        fleet.stop()


def test_streaming_completion_end_to_end(stack: tuple[SimFleet, Predictor, Route, Path]) -> None:
    fleet, _, route, _ = stack
    response, events = stream_request(route.url, "tell me a story " * 40, 12)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-leadtime-endpoint"] in {"h100-0", "l40s-0"}
    assert float(response.headers["x-leadtime-route-ms"]) > 0
    assert events[-1] == "[DONE]"
    chunks = token_events(events)
    assert [c["choices"][0]["text"] for c in chunks] == [f" tok{i}" for i in range(12)]  # type: ignore[index]


def test_streaming_chat_passes_the_usage_chunk_and_request_headers(
    stack: tuple[SimFleet, Predictor, Route, Path],
) -> None:
    _, _, route, _ = stack
    body = {
        "messages": [{"role": "user", "content": "hello " * 30}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {**JSON, "x-request-id": "req-42"}
    with httpx.stream("POST", f"{route.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-42"  # the endpoint saw the client's header
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_non_streaming_answers_and_errors_pass_through(stack: tuple[SimFleet, Predictor, Route, Path]) -> None:
    _, _, route, _ = stack
    reply = httpx.post(f"{route.url}/v1/completions", json={"prompt": "a b c", "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert reply.headers["content-length"] == str(len(reply.content))
    refused = httpx.post(f"{route.url}/v1/completions", json={"prompt": "a", "max_tokens": 0}, timeout=60)
    assert refused.status_code == 422  # the endpoint's own answer, passed through
    assert refused.json()["field"] == "max_tokens" and refused.headers["x-leadtime-endpoint"]
    broken = httpx.post(f"{route.url}/v1/completions", content=b'{"prompt": ', headers=JSON, timeout=10)
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "body"
    bad_slo = httpx.post(
        f"{route.url}/v1/completions", json={"prompt": "x"}, headers={"x-llm-d-slo-ttft-ms": "-3"}, timeout=10
    )
    assert bad_slo.status_code == 422 and bad_slo.json()["error"]["param"] == "x-llm-d-slo-ttft-ms"
    assert httpx.get(f"{route.url}/healthz", timeout=5).json() == {"status": "ok"}
    assert httpx.get(f"{route.url}/v1/models", timeout=5).json()["data"][0]["id"] == "llama-3.1-8b"


def post_expecting_continue(url: str, path: str, body: bytes) -> tuple[list[int], bytes]:
    """POST as curl does with a large body: headers with `Expect: 100-continue`, the body once the server says
    100 Continue; the status lines received and the final response's bytes after its headers."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        interim = sock.recv(1024)
        sock.sendall(body)
        received = interim
        while chunk := sock.recv(65536):
            received += chunk
    statuses = [int(line.split()[1]) for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    final = received[received.rindex(b"HTTP/1.1 ") :]
    return statuses, final.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/completions", {"prompt": "a b c", "max_tokens": 3}, b'"completion_tokens":3'),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, b"[DONE]"),
        ("/tokenize", {"prompt": "a b c"}, b'"tokens"'),
    ],
)
def test_a_client_expecting_100_continue_gets_the_endpoints_answer(
    stack: tuple[SimFleet, Predictor, Route, Path], path: str, body: dict[str, object], expected: bytes
) -> None:
    """curl sends `Expect: 100-continue` with any body over 1 MB: the interim 100 is the gateway's to answer,
    and the client gets the endpoint's final answer after it, not an empty one."""
    _, _, route, _ = stack
    statuses, answer = post_expecting_continue(route.url, path, json.dumps(body).encode())
    assert statuses == [100, 200]
    assert expected in answer


def test_observations_reach_the_predictor(stack: tuple[SimFleet, Predictor, Route, Path]) -> None:
    _, predictor, route, _ = stack
    before = httpx.get(f"{predictor.url}/v1/status", timeout=5).json()["learned"]
    with ThreadPoolExecutor(4) as pool:
        for response, _ in pool.map(lambda i: stream_request(route.url, f"question {i} " * 20, 6), range(8)):
            assert response.status_code == 200
    learned = learned_after(predictor, before, 8)
    fell_back = sum(route.metric("leadtime_router_fallbacks_total", reason=r) for r in FALLBACK_REASONS)
    # Requests the heuristics decided (a predict call past its deadline on a loaded machine) are learned too.
    assert learned["ttft"] >= before["ttft"] + 8 and learned["tpot"] >= before["tpot"] + 8, (learned, fell_back)
    assert route.metric("leadtime_router_observations_total", result="sent") >= 8
    assert route.metric("leadtime_router_ttft_seconds_count", kind="predicted") + fell_back >= 8
    assert route.metric("leadtime_router_picks_total") >= 8


def test_the_processes_export_no_created_series(stack: tuple[SimFleet, Predictor, Route, Path]) -> None:
    """prometheus_client adds a `_created` sample beside every counter and histogram series, which Prometheus's text
    format stores as series of their own (a sixth of the samples, per endpoint at the gateway), read by no
    dashboard or alert: `leadtime serve` and `leadtime route`, which own their processes, turn them off."""
    _, predictor, route, _ = stack
    for url in (predictor.url, route.url):
        text = httpx.get(f"{url}/metrics", timeout=5).text
        assert "_total" in text and "_created" not in text, url


def learned_after(predictor: Predictor, before: dict[str, int], more: int) -> dict[str, int]:
    """The predictor's count of rows learned, once it has learned `more` of each target than `before` (or 20 s)."""
    deadline = time.monotonic() + 20
    learned = before
    while time.monotonic() < deadline:
        learned = httpx.get(f"{predictor.url}/v1/status", timeout=5).json()["learned"]
        if learned["ttft"] >= before["ttft"] + more and learned["tpot"] >= before["tpot"] + more:
            break
        time.sleep(0.2)
    return learned


def test_non_streaming_requests_are_measured_answered_whole_and_learned(
    stack: tuple[SimFleet, Predictor, Route, Path],
) -> None:
    _, predictor, route, _ = stack
    before = httpx.get(f"{predictor.url}/v1/status", timeout=5).json()["learned"]
    measured = route.metric("leadtime_router_non_streaming_total", measured="true")
    for i in range(4):
        reply = httpx.post(f"{route.url}/v1/completions", json={"prompt": f"whole {i} " * 20, "max_tokens": 3})
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
        # Put back together from the stream the gateway asked for (measured: the counter below says so).
        assert reply.json()["choices"] == [
            {"index": 0, "text": " tok0 tok1 tok2", "logprobs": None, "finish_reason": "length"}
        ]
    learned = learned_after(predictor, before, 4)
    assert learned["ttft"] >= before["ttft"] + 4 and learned["tpot"] >= before["tpot"] + 4, learned
    assert route.metric("leadtime_router_non_streaming_total", measured="true") == measured + 4


def test_told_not_to_measure_the_gateway_sends_non_streaming_requests_unchanged(
    round_robin: tuple[Route, Path, FleetServer],
) -> None:
    route, _, _ = round_robin
    reply = httpx.post(f"{route.url}/v1/completions", json={"prompt": "whole please", "max_tokens": 3}, timeout=30)
    assert reply.status_code == 200
    endpoints_own = {"index": 0, "text": " tok0 tok1 tok2", "finish_reason": "length", "logprobs": None}
    assert reply.json()["choices"] == [endpoints_own]
    assert route.metric("leadtime_router_non_streaming_total", measured="false") >= 1
    assert route.metric("leadtime_router_non_streaming_total", measured="true") == 0


def _replace(path: Path, content: bytes) -> None:
    """Write a new version of the file the way an editor or a config manager does: a new file, renamed over it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(content)
    tmp.replace(path)


def test_a_broken_discovery_file_keeps_the_previous_set(stack: tuple[SimFleet, Predictor, Route, Path]) -> None:
    _, _, route, discovery = stack
    good = discovery.read_bytes()
    errors = route.metric("leadtime_router_discovery_reloads_total", result="error")
    try:
        _replace(discovery, b"endpoints: [{name: broken")
        wait_for(lambda: route.metric("leadtime_router_discovery_reloads_total", result="error") > errors, timeout_s=10)
        _replace(discovery, b"# padding\n" * 110_000)  # over 1 MiB
        wait_for(
            lambda: route.metric("leadtime_router_discovery_reloads_total", result="error") > errors + 1, timeout_s=10
        )
        assert httpx.get(f"{route.url}/readyz", timeout=5).json()["routable_endpoints"] == 2
        response, events = stream_request(route.url, "still routed", 3)
        assert response.status_code == 200 and len(token_events(events)) == 3
        assert "keeping the previous 2 endpoints" in route.child.output()
        only_h100 = yaml.safe_load(good)
        only_h100["endpoints"] = [e for e in only_h100["endpoints"] if e["name"] == "h100-0"]
        _replace(discovery, yaml.safe_dump(only_h100).encode())
        wait_for(lambda: httpx.get(f"{route.url}/readyz", timeout=5).json()["endpoints"] == 1, timeout_s=10)
        for _ in range(3):
            response, _ = stream_request(route.url, "where do I go", 2)
            assert response.headers["x-leadtime-endpoint"] == "h100-0"
    finally:
        _replace(discovery, good)
        wait_for(
            lambda: httpx.get(f"{route.url}/readyz", timeout=5).json().get("routable_endpoints") == 2, timeout_s=10
        )


@pytest.fixture(scope="module")
def round_robin(
    workdir: Path, stack: tuple[SimFleet, Predictor, Route, Path]
) -> Iterator[tuple[Route, Path, FleetServer]]:
    """A round-robin gateway over the two endpoints plus one more served from this process (so it can be stopped)."""
    fleet, _, _, _ = stack
    extra = FleetServer(
        parse_fleet({"pools": [{"name": "spare", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]}),
        [free_port()],
    )
    extra.start()
    entries = yaml.safe_load(fleet.endpoints_file.read_text())
    entries["endpoints"].append(
        {
            "name": "spare-0",
            "address": "127.0.0.1",
            "port": str(extra.ports[0]),
            "labels": {"leadtime.io/accelerator": "h100-sxm"},
        }
    )
    discovery = workdir / "discovery-rr.yaml"
    discovery.write_text(yaml.safe_dump(entries))
    route = Route(
        workdir,
        ["--discovery", str(discovery), "--policy", "round-robin", "--unroutable-after-s", "2"]
        + ["--no-measure-non-streaming"],
    )
    try:
        route.wait()
        wait_for(
            lambda: httpx.get(f"{route.url}/readyz", timeout=5).json().get("routable_endpoints") == 3, timeout_s=10
        )
        yield route, discovery, extra
    finally:
        route.child.stop()
        extra.stop()


def test_an_endpoint_whose_scrapes_fail_is_retried_around_then_left_out(
    round_robin: tuple[Route, Path, FleetServer],
) -> None:
    route, _, extra = round_robin
    extra.stop()  # the endpoint goes away: scrapes and requests to it fail from now on
    wait_for(lambda: route.metric("leadtime_router_scrape_errors_total", endpoint="spare-0") > 0, timeout_s=5)
    # Still within --unroutable-after-s: the endpoint is marked but may be picked; a pick fails before any byte
    # and the request is retried on another endpoint.
    answered = [stream_request(route.url, f"retry me {i}", 2) for i in range(3)]
    assert all(r.status_code == 200 and len(token_events(e)) == 2 for r, e in answered)
    assert route.metric("leadtime_router_retries_total") >= 1
    assert route.metric("leadtime_router_upstream_errors_total", endpoint="spare-0", kind="connect") >= 1
    wait_for(lambda: route.metric("leadtime_router_endpoint_routable", endpoint="spare-0") == 0, timeout_s=6)
    retries = route.metric("leadtime_router_retries_total")
    for i in range(6):
        response, _ = stream_request(route.url, f"after {i}", 2)
        assert response.status_code == 200 and response.headers["x-leadtime-endpoint"] != "spare-0"
    assert route.metric("leadtime_router_retries_total") == retries


def test_a_gateway_with_an_api_key_serves_only_clients_that_show_it(
    workdir: Path, stack: tuple[SimFleet, Predictor, Route, Path]
) -> None:
    fleet, _, _, _ = stack
    route = Route(workdir, ["--discovery", str(fleet.endpoints_file), "--policy", "round-robin", "--api-key", "s3cret"])
    try:
        route.wait()
        body = {"prompt": "let me in", "max_tokens": 2}
        refused = httpx.post(f"{route.url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["param"] == "authorization"
        shown = {"authorization": "Bearer s3cret"}
        answered = httpx.post(f"{route.url}/v1/completions", json=body, headers=shown, timeout=30)
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 2
        assert route.metric("leadtime_router_requests_total", path="/v1/completions", code="401") == 1
    finally:
        route.child.stop()


def test_a_shadowed_round_robin_gateway_teaches_the_predictor_what_its_picks_did(
    workdir: Path, stack: tuple[SimFleet, Predictor, Route, Path]
) -> None:
    fleet, predictor, _, _ = stack
    args = ["--discovery", str(fleet.endpoints_file), "--policy", "round-robin", "--shadow"]
    route = Route(workdir, [*args, "--predictor-url", predictor.url])
    try:
        route.wait()
        before = httpx.get(f"{predictor.url}/v1/status", timeout=5).json()["learned"]
        picked = [
            stream_request(route.url, f"shadowed {i} " * 30, 4)[0].headers["x-leadtime-endpoint"] for i in range(4)
        ]
        assert picked[:2] == picked[2:] and len(set(picked)) == 2  # round-robin's turns, whatever was predicted
        learned = learned_after(predictor, before, 4)
        assert learned["ttft"] >= before["ttft"] + 4 and learned["tpot"] >= before["tpot"] + 4, learned
        assert route.metric("leadtime_router_ttft_seconds_count", kind="predicted") >= 1
    finally:
        route.child.stop()


def test_an_endpoint_never_scraped_is_not_routed_to(workdir: Path) -> None:
    dead = free_port()
    route = Route(workdir, ["--endpoint", f"127.0.0.1:{dead},name=ghost", "--policy", "round-robin"])
    try:
        route.child.wait_until(f"{route.url}/readyz", status=503)
        ready = httpx.get(f"{route.url}/readyz", timeout=10).json()
        assert ready["reason"] == "no endpoint can be routed to (none answered a scrape within the last 3 s)"
        reply = httpx.post(f"{route.url}/v1/completions", json={"prompt": "anyone?"}, timeout=10)
        assert reply.status_code == 503 and "no endpoint" in reply.json()["error"]["message"]
    finally:
        route.child.stop()


@pytest.fixture(scope="module")
def disposable(workdir: Path, stack: tuple[SimFleet, Predictor, Route, Path]) -> Iterator[tuple[Predictor, Route]]:
    """A predictor of its own and a gateway using it over gRPC, for the test that kills the predictor."""
    fleet, _, _, _ = stack
    predictor = Predictor(workdir).wait()
    route = Route(workdir, ["--discovery", str(fleet.endpoints_file), "--predictor-grpc", predictor.grpc])
    try:
        route.wait()
        yield predictor, route
    finally:
        route.child.stop()
        predictor.child.stop()


def test_the_predictor_killed_mid_traffic_every_request_is_answered(disposable: tuple[Predictor, Route]) -> None:
    predictor, route = disposable
    results: list[tuple[int, int]] = []

    def one(i: int) -> tuple[int, int]:
        response, events = stream_request(route.url, f"traffic {i} " * 10, 4)
        return response.status_code, len(token_events(events))

    def gone() -> float:  # fallbacks because the predictor cannot be reached at all
        return sum(route.metric("leadtime_router_fallbacks_total", reason=r) for r in ("unavailable", "circuit_open"))

    def fallbacks() -> float:  # for any reason: on a busy machine a dead predictor's calls may time out first
        return sum(route.metric("leadtime_router_fallbacks_total", reason=r) for r in FALLBACK_REASONS)

    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(one, range(8)))
        assert gone() == 0
        before = fallbacks()
        predictor.child.kill()
        results = first + list(pool.map(one, range(8, 32)))
    assert results == [(200, 4)] * 32
    assert fallbacks() - before >= 24  # every decision after the kill: by the heuristics
    assert route.metric("leadtime_router_requests_total", code="200") == 32


class _SlowPredictor(BaseHTTPRequestHandler):
    """Answers predictions after 300 ms (far beyond the 20 ms deadline) and takes observations at once."""

    calls: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        type(self).calls.append(self.path)
        if self.path == "/v1/predict":
            time.sleep(0.3)
            n = len(body.get("rows", []))
            answer = {k: [100.0] * n for k in ("ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms")}
            payload = json.dumps({**answer, "model_version": 1, "quantile": 0.9}).encode()
            status = 200
        else:
            payload, status = json.dumps({"accepted": len(body.get("observations", []))}).encode(), 202
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the gateway gave up waiting, as it should

    def log_message(self, *args: object) -> None:
        pass


def test_a_slow_predictor_costs_at_most_the_deadline(
    workdir: Path, stack: tuple[SimFleet, Predictor, Route, Path]
) -> None:
    fleet, _, _, _ = stack
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowPredictor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    route = Route(workdir, ["--discovery", str(fleet.endpoints_file), "--predictor-url", url])
    try:
        route.wait()
        routing_ms = []
        for i in range(10):
            response, events = stream_request(route.url, f"in a hurry {i}", 3)
            assert response.status_code == 200 and len(token_events(events)) == 3
            routing_ms.append(float(response.headers["x-leadtime-route-ms"]))
        assert max(routing_ms) < 150, routing_ms  # the 20 ms deadline, with room for a loaded machine; never 300
        assert route.metric("leadtime_router_fallbacks_total") == 10
        assert route.metric("leadtime_router_fallbacks_total", reason="deadline") >= 1
        assert route.metric("leadtime_router_fallbacks_total", reason="circuit_open") >= 1
        assert _SlowPredictor.calls.count("/v1/predict") < 10  # the breaker spared the rest
    finally:
        route.child.stop()
        server.shutdown()
