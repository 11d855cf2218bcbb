"""Endpoints that fail their requests while their /metrics says they are idle: a latency router's favourite, unless
the gateway takes them out of routing (outlier ejection)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from raw_endpoint import STREAM_HEAD, Handler, fleet_of, next_request, write_endpoints

from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.discovery import FileDiscovery
from leadtime.router_plugin.gateway import upstream
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.metrics import STATUS_CLASSES
from leadtime.router_plugin.gateway.outliers import CONSECUTIVE_FAILURES, Outliers
from leadtime.router_plugin.gateway.upstream import REQUEST_FAILURE_KINDS
from leadtime.router_plugin.policy import Candidate, Pick, RouteRequest

ANSWER = b'data: {"choices":[{"index":0,"text":" ok"}]}\n\ndata: [DONE]\n\n'


class FirstByName:
    """Picks the candidate whose id sorts first: "bad" whenever it is offered, as a latency router picks an endpoint
    that looks idle; keeps the outcomes it is taught."""

    def __init__(self) -> None:
        self.outcomes: list[Any] = []

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> Pick:
        return Pick(min(c.endpoint_id for c in candidates))

    def observe(self, outcome: Any) -> None:
        self.outcomes.append(outcome)


def serving(answer: Callable[[asyncio.StreamWriter], None], connections: list[Any] | None = None) -> Handler:
    """An endpoint answering /metrics idle and every other request with `answer` (its connections kept in
    `connections`, for a test to close)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections.append(writer)
        while await next_request(reader, writer) is not None:
            answer(writer)
            await writer.drain()

    return handle


def answers_well(writer: asyncio.StreamWriter) -> None:
    writer.write(STREAM_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(ANSWER), ANSWER))


def answers_status(status: int) -> Callable[[asyncio.StreamWriter], None]:
    def answer(writer: asyncio.StreamWriter) -> None:
        body = b'{"error": "no"}'
        writer.write(b"HTTP/1.1 %d Oops\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))

    return answer


def answers_garbage_stream(writer: asyncio.StreamWriter) -> None:
    garbage = b"data: {not json}\n\ndata: [DONE]\n\n"
    writer.write(STREAM_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(garbage), garbage))


def fleet(
    settings: GatewaySettings | None = None, **handlers: Handler
) -> contextlib.AbstractAsyncContextManager[tuple[Gateway, httpx.AsyncClient, dict[str, Any]]]:
    """A gateway (picking `FirstByName`) in front of hand-written endpoints named as the keyword arguments."""
    return fleet_of(handlers, FirstByName(), settings)


async def post(client: httpx.AsyncClient, n: int) -> list[tuple[int, str]]:
    out = []
    for _ in range(n):
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        out.append((r.status_code, r.headers.get("x-leadtime-endpoint", "")))
    return out


def count(samples: dict[str, Any], name: str, **labels: str) -> float:
    return sum(v for got, v in samples.get(name, []) if all(got.get(k) == want for k, want in labels.items()))


def test_an_endpoint_answering_500_at_once_is_taken_out_after_five_in_a_row(caplog: pytest.LogCaptureFixture) -> None:
    """It looked idle, so every request went to it (96 % of a tester's traffic got a 500). Five 500s in a row take
    it out; the requests go to the endpoint that serves; said once in the log, counted, named by /readyz."""

    async def go() -> tuple[list[tuple[int, str]], dict[str, Any], dict[str, Any]]:
        async with fleet(bad=serving(answers_status(500)), good=serving(answers_well)) as (gateway, client, _):
            results = await post(client, 12)
            samples = parse_samples((await client.get("/metrics")).text)
            ready = (await client.get("/readyz")).json()
        return results, samples, ready

    with caplog.at_level(logging.INFO):
        results, samples, ready = asyncio.run(go())
    assert results == [(500, "bad")] * CONSECUTIVE_FAILURES + [(200, "good")] * (12 - CONSECUTIVE_FAILURES)
    assert count(samples, "leadtime_router_endpoint_ejections_total", endpoint="bad") == 1
    assert count(samples, "leadtime_router_upstream_responses_total", endpoint="bad", status="5xx") == 5
    assert count(samples, "leadtime_router_upstream_responses_total", endpoint="good", status="2xx") == 7
    assert count(samples, "leadtime_router_endpoint_routable", endpoint="bad") == 0
    assert "answered 500 (5 failures in a row)" in ready["degraded"]["endpoint bad"]
    said = [r.getMessage() for r in caplog.records if "taken out of routing" in r.getMessage()]
    assert said == ["bad taken out of routing for 30 s: answered 500 (5 failures in a row)"]


def test_a_503_is_retried_on_another_endpoint_and_counts_against_its_endpoint() -> None:
    """A gateway error (502/503/504) means nothing was generated: the client gets the other endpoint's answer."""

    async def go() -> tuple[list[tuple[int, str]], dict[str, Any]]:
        async with fleet(bad=serving(answers_status(503)), good=serving(answers_well)) as (gateway, client, _):
            results = await post(client, 8)
            samples = parse_samples((await client.get("/metrics")).text)
        return results, samples

    results, samples = asyncio.run(go())
    assert results == [(200, "good")] * 8
    assert count(samples, "leadtime_router_retries_total") == CONSECUTIVE_FAILURES  # then it was out
    assert count(samples, "leadtime_router_endpoint_ejections_total", endpoint="bad") == 1


def test_a_refused_connection_takes_the_endpoint_out_at_once_until_it_accepts_again() -> None:
    """Its port closed (the pod died): nothing sent there is served. The first request is retried elsewhere, the
    next ones do not try it at all (the scrapes alone took 3 s to say so)."""

    async def go() -> tuple[list[tuple[int, str]], float, list[str]]:
        connections: list[Any] = []
        async with fleet(bad=serving(answers_well, connections), good=serving(answers_well)) as (
            gateway,
            client,
            servers,
        ):
            servers["bad"].close()  # no new connection; the gateway's open ones closed too
            for writer in connections:
                writer.close()
            await asyncio.sleep(0.2)
            results = await post(client, 4)
            samples = parse_samples((await client.get("/metrics")).text)
            out = list(gateway.outliers.health())
        return results, count(samples, "leadtime_router_retries_total"), out

    results, retries, out = asyncio.run(go())
    assert results == [(200, "good")] * 4
    assert retries == 1 and out == ["bad"]


def test_a_stream_with_no_event_in_it_is_a_502_for_a_client_that_did_not_stream() -> None:
    """`data: {not json}` then `[DONE]` was assembled into a 200 with `"choices": []`, which a client reading
    choices[0] fails on; it is the endpoint's failure, named."""

    async def go() -> httpx.Response:
        async with fleet(bad=serving(answers_garbage_stream)) as (gateway, client, _):
            return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    response = asyncio.run(go())
    assert response.status_code == 502 and response.headers["x-leadtime-endpoint"] == "bad"
    assert "no event" in response.json()["error"]["message"]


EMPTY_TEXT = (
    b'data: {"id":"c1","object":"text_completion","model":"m","choices":[{"index":0,"text":"","finish_reason":"stop"}]}'
    b'\n\ndata: {"id":"c1","object":"text_completion","model":"m","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n'
)
EMPTY_CONTENT = (
    b'data: {"id":"c2","object":"chat.completion.chunk","model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"c2","object":"chat.completion.chunk","model":"m",'
    b'"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)


async def answers_empty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """What vLLM streams when an answer is empty (EOS or a stop string at once): a choice whose text is "" (on
    chat, the message's content "")."""
    while (head := await next_request(reader, writer)) is not None:
        events = EMPTY_CONTENT if head.startswith(b"POST /v1/chat/") else EMPTY_TEXT
        writer.write(STREAM_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
        await writer.drain()


def test_an_empty_answer_to_a_non_streaming_request_is_an_answer_not_the_endpoints_failure() -> None:
    """Regression: a non-streaming request whose answer had no text (EOS at once, `"text": ""`) got a 502 "answered
    a stream with no event in it", counted as the endpoint's failure: five of them took a healthy endpoint out of
    routing for 30 s. vLLM answers such a request 200 with the text "" (on chat, the content "")."""

    async def go() -> tuple[list[httpx.Response], httpx.Response, dict[str, str]]:
        async with fleet(a=answers_empty) as (gateway, client, _):
            body = {"prompt": "hi", "max_tokens": 5, "stop": ["\n"]}
            texts = [await client.post("/v1/completions", json=body) for _ in range(CONSECUTIVE_FAILURES + 1)]
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            return texts, chat, gateway.outliers.health()

    texts, chat, out = asyncio.run(go())
    for response in texts:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert out == {}  # the endpoint is not out of routing


def test_with_most_endpoints_out_the_gateway_routes_to_all_of_them_rather_than_answer_503() -> None:
    """A failure every endpoint shares (a request type each pod answers 500) is no endpoint's: taking them all out
    answered every request 503 for up to 300 s. Below half of them in, all are routed to (Envoy's panic threshold);
    the client gets the endpoint's own answer, and /readyz says so."""

    async def go() -> tuple[list[tuple[int, str]], dict[str, Any]]:
        async with fleet(bad=serving(answers_status(500))) as (gateway, client, _):
            results = await post(client, 7)
            return results, (await client.get("/readyz")).json()

    results, ready = asyncio.run(go())
    assert results == [(500, "bad")] * 7
    assert "routing to all of them" in ready["degraded"]["endpoints"] and "endpoint bad" in ready["degraded"]


def test_streams_that_break_after_their_status_take_the_endpoint_out() -> None:
    """A 200 then a cut stream: the status line alone counted as a success and cleared the record, so broken streams
    never added up to an ejection."""

    def breaks_mid_stream(writer: asyncio.StreamWriter) -> None:
        half = b'data: {"choices":[{"index":0,"text":" a"}]}\n\ndata: {"cho'
        writer.write(STREAM_HEAD + b"%x\r\n%s\r\n" % (len(half), half))
        writer.transport.abort()

    async def go() -> tuple[list[tuple[int, str]], dict[str, Any]]:
        async with fleet(bad=serving(breaks_mid_stream), good=serving(answers_well)) as (gateway, client, _):
            results = await post(client, 8)
            return results, parse_samples((await client.get("/metrics")).text)

    results, samples = asyncio.run(go())
    assert results == [(502, "bad")] * CONSECUTIVE_FAILURES + [(200, "good")] * 3
    assert count(samples, "leadtime_router_endpoint_ejections_total", endpoint="bad") == 1


ERROR_EVENT = b'data: {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}\n\n'


def fails_in_its_stream(tokens: int) -> Callable[[asyncio.StreamWriter], None]:
    """What vLLM sends when generation raises once it has answered 200: `tokens` tokens, then its error event and
    `[DONE]`."""

    def answer(writer: asyncio.StreamWriter) -> None:
        events = b"".join(b'data: {"choices":[{"index":0,"text":" t%d"}]}\n\n' % i for i in range(tokens))
        events += ERROR_EVENT + b"data: [DONE]\n\n"
        writer.write(STREAM_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))

    return answer


def test_an_error_event_in_a_200_stream_is_the_endpoints_failure() -> None:
    """Regression: an endpoint failing every request with vLLM's error event in a 200 stream was counted as
    answering 2xx, never taken out (so, looking idle, it got nearly everything), and /readyz said nothing, while the
    gateway answered its non-streaming clients 500."""

    async def go() -> tuple[list[httpx.Response], dict[str, Any]]:
        async with fleet(bad=serving(fails_in_its_stream(0)), good=serving(answers_well)) as (gateway, client, _):
            results = []
            for i in range(CONSECUTIVE_FAILURES + 3):
                body = {"prompt": "hi", "max_tokens": 2, "stream": i % 2 == 0}
                results.append(await client.post("/v1/completions", json=body))
            return results, parse_samples((await client.get("/metrics")).text)

    results, samples = asyncio.run(go())
    failed, served = results[:CONSECUTIVE_FAILURES], results[CONSECUTIVE_FAILURES:]
    assert [r.headers["x-leadtime-endpoint"] for r in failed] == ["bad"] * CONSECUTIVE_FAILURES
    assert [r.status_code for r in failed] == [200, 500, 200, 500, 200]  # a stream's status went before its error
    assert all(b"engine failed" in r.content for r in failed)
    assert [(r.status_code, r.headers["x-leadtime-endpoint"]) for r in served] == [(200, "good")] * 3
    assert count(samples, "leadtime_router_endpoint_ejections_total", endpoint="bad") == 1
    assert count(samples, "leadtime_router_upstream_responses_total", endpoint="bad", status="5xx") == 5
    assert count(samples, "leadtime_router_upstream_responses_total", endpoint="bad", status="2xx") == 0
    assert count(samples, "leadtime_router_requests_total", path="/v1/completions", code="500") == 5


def test_a_stream_failed_by_its_error_event_after_tokens_teaches_nothing_and_meets_no_slo() -> None:
    """Regression: three tokens, then vLLM's error event: the failed request was learned from (its TTFT sent to the
    predictor) and counted as meeting its SLO."""

    async def go() -> tuple[list[httpx.Response], dict[str, Any], tuple[int, int], list[Any]]:
        async with fleet(bad=serving(fails_in_its_stream(3))) as (gateway, client, _):
            assert isinstance(gateway.policy, FirstByName)
            headers = {"x-llm-d-slo-ttft-ms": "5000"}
            results = []
            for stream in (True, False):
                body = {"prompt": "hi", "max_tokens": 5, "stream": stream}
                results.append(await client.post("/v1/completions", json=body, headers=headers))
            work = gateway.work.tokens("bad", published_ms=float("inf"))
            return results, parse_samples((await client.get("/metrics")).text), work, gateway.policy.outcomes

    (streamed, whole), samples, work, outcomes = asyncio.run(go())
    assert streamed.status_code == 200 and b" t2" in streamed.content and b"engine failed" in streamed.content
    assert whole.status_code == 500 and whole.json()["error"]["message"] == "engine failed"
    assert outcomes == [] and work == (0, 0)
    assert count(samples, "leadtime_router_ttft_seconds_count") == 0
    assert count(samples, "leadtime_router_slo_total") == 0
    assert count(samples, "leadtime_router_upstream_responses_total", endpoint="bad", status="5xx") == 2
    assert count(samples, "leadtime_router_requests_total", path="/v1/completions", code="500") == 2


def test_a_503_from_the_only_endpoint_left_is_its_answer_not_the_gateways() -> None:
    """With nowhere to retry, the endpoint's 503 (its body, its Retry-After) was thrown away for the gateway's own."""

    async def go() -> httpx.Response:
        async with fleet(bad=serving(answers_status(503))) as (gateway, client, _):
            return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    response = asyncio.run(go())
    assert response.status_code == 503 and response.json() == {"error": "no"}


def test_every_discovered_endpoint_has_an_ejection_series_from_the_start() -> None:
    """An alert on increase() misses a counter's first step from nothing: the series exist at 0."""

    async def go() -> dict[str, Any]:
        async with fleet(a=serving(answers_well), b=serving(answers_well)) as (gateway, client, _):
            return parse_samples((await client.get("/metrics")).text)

    samples = asyncio.run(go())
    series = {s["endpoint"]: v for s, v in samples["leadtime_router_endpoint_ejections_total"]}
    assert series == {"a": 0.0, "b": 0.0}


def test_every_discovered_endpoint_has_its_error_and_answer_series_at_0_from_the_start() -> None:
    """The same for each endpoint's failures by kind and answers by status class: the first failure of an
    endpoint is what the endpoint-errors alert and panel exist to show, and a series born at 1 showed none."""

    async def go() -> dict[str, Any]:
        async with fleet(a=serving(answers_well), b=serving(answers_well)) as (gateway, client, _):
            return parse_samples((await client.get("/metrics")).text)

    samples = asyncio.run(go())
    errors = {(s["endpoint"], s["kind"]): v for s, v in samples["leadtime_router_upstream_errors_total"]}
    assert errors == {(e, kind): 0.0 for e in "ab" for kind in REQUEST_FAILURE_KINDS}
    answers = {(s["endpoint"], s["status"]): v for s, v in samples["leadtime_router_upstream_responses_total"]}
    assert answers == {(e, status): 0.0 for e in "ab" for status in STATUS_CLASSES}


def test_the_failure_kinds_listed_are_every_kind_a_request_upstream_can_fail_with() -> None:
    """The kinds exported at 0 are the ones `upstream.py` raises: a kind added there and not listed would again
    appear only with its first failure."""
    source = Path(upstream.__file__).read_text()
    raised = set(re.findall(r'UpstreamError\(\s*"(\w+)"', source))
    assert raised == set(REQUEST_FAILURE_KINDS)


def test_a_late_failure_of_a_request_sent_before_the_endpoint_came_back_is_not_held_against_it() -> None:
    now = [0.0]
    outliers = Outliers(lambda: now[0], consecutive=1, base_s=10)
    outliers.failed("e", "answered 500", sent_ms=0.0)
    now[0] = 10_000.0
    assert not outliers.out("e")  # back, on probation
    outliers.failed("e", "timeout: no data", sent_ms=5_000.0)  # sent while it was out... before it came back
    assert not outliers.out("e")
    outliers.failed("e", "answered 500", sent_ms=10_001.0)
    assert outliers.out("e")


def test_ejections_back_off_and_a_success_clears_the_record() -> None:
    now = [0.0]
    outliers = Outliers(lambda: now[0], consecutive=2, base_s=10, max_s=25)
    for _ in range(2):
        outliers.failed("e", "answered 500")
    assert outliers.out("e")
    now[0] = 10_000.0
    assert not outliers.out("e")  # back after 10 s, on probation
    outliers.failed("e", "answered 500")
    assert outliers.out("e") and "back in 20 s" in outliers.health()["e"]
    now[0] = 30_000.0
    assert not outliers.out("e")
    outliers.answered("e")  # served: a clean record, the next ejection is 10 s again after 2 failures
    outliers.failed("e", "answered 500")
    assert not outliers.out("e")
    outliers.failed("e", "answered 500")
    assert "back in 10 s" in outliers.health()["e"]
    outliers.keep_only(["other"])
    assert not outliers.out("e")


def test_a_refused_endpoint_is_back_with_the_first_scrape_asked_after_the_refusal() -> None:
    now = [5.0]
    outliers = Outliers(lambda: now[0])
    outliers.failed("e", "connect: refused", refused=True)
    outliers.scraped("e", 4.0)  # asked before: says nothing of now
    assert outliers.out("e")
    outliers.scraped("e", 6.0)
    assert not outliers.out("e")


def test_an_endpoint_that_never_answers_fails_the_request_after_the_upstream_timeout() -> None:
    """It accepted the request and said nothing: the client waited the fixed 600 s. `--upstream-timeout-s` bounds
    the wait; nothing was answered, so the request goes elsewhere, and the silence counts against the endpoint."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await next_request(reader, writer) is not None:
            await asyncio.sleep(30)

    async def go() -> tuple[list[tuple[int, str]], dict[str, Any]]:
        settings = GatewaySettings(upstream_timeout_s=0.3)
        async with fleet(settings, bad=silent, good=serving(answers_well)) as (gateway, client, _):
            results = await post(client, 2)
            samples = parse_samples((await client.get("/metrics")).text)
        return results, samples

    results, samples = asyncio.run(go())
    assert results == [(200, "good")] * 2
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="bad", kind="timeout") == 2


def test_only_a_refused_connection_is_told_apart_as_refused() -> None:
    """A closed port takes an endpoint out at once; a connect timeout (an overloaded host) is one failure of five."""
    from leadtime.bench.procs import free_port
    from leadtime.router_plugin.gateway.upstream import UpstreamError, Upstreams

    async def go() -> UpstreamError:
        upstreams = Upstreams(2.0)
        try:
            await upstreams.pool("127.0.0.1", free_port()).request("GET", "/", timeout_s=2.0)
        except UpstreamError as err:
            return err
        finally:
            upstreams.close()
        raise AssertionError("a closed port answered")

    err = asyncio.run(go())
    assert err.kind == "connect" and err.refused
    assert str(err).endswith(": connection refused")  # said so on any event loop (asyncio's: "Connect call failed")
    assert not UpstreamError("connect", "did not accept within 2 s").refused


def endpoints_named(text: str) -> set[str]:
    """Every `endpoint` label value in a /metrics body."""
    return {s.get("endpoint", "") for series in parse_samples(text).values() for s, _ in series} - {""}


def test_endpoints_renamed_by_discovery_leave_no_series_of_their_old_names(tmp_path: Path) -> None:
    """In Kubernetes an endpoint's name is its pod's: a rollout renames every endpoint. The picks, estimated prefix
    hits and scrape errors of the old names stayed in /metrics for ever (a soak test: 317 → 979 lines in 24 min)."""
    path = tmp_path / "endpoints.json"

    async def go() -> tuple[set[str], set[str], list[tuple[int, str]]]:
        servers = [await asyncio.start_server(serving(answers_well), "127.0.0.1", 0) for _ in range(2)]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        with socket.socket() as closed:  # a port nothing listens on: every scrape of it fails
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
        write_endpoints(path, {"a-1": ports[0], "b-1": ports[1], "dead-1": dead})
        settings = GatewaySettings(discovery_poll_s=0.02, scrape_interval_s=0.01)
        gateway = Gateway(FileDiscovery(path), FirstByName(), settings)  # type: ignore[arg-type]
        await gateway.start()
        try:
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                while len(gateway.routable()) < 2 or gateway.scraper.scrapes["dead-1"].errors == 0:
                    await asyncio.sleep(0.02)
                prompt = "the same long prompt, twice, so that the second is estimated cached " * 4
                results = [
                    (r.status_code, r.headers["x-leadtime-endpoint"])
                    for r in [
                        await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}) for _ in range(2)
                    ]
                ]
                before = endpoints_named((await client.get("/metrics")).text)
                write_endpoints(path, {"a-2": ports[0], "b-2": ports[1]})
                while set(gateway.scraper.scrapes) != {"a-2", "b-2"}:
                    await asyncio.sleep(0.02)
                after = endpoints_named((await client.get("/metrics")).text)
        finally:
            await gateway.stop()
            for s in servers:
                s.close()
        return before, after, results

    before, after, results = asyncio.run(go())
    assert results == [(200, "a-1"), (200, "a-1")]
    assert before == {"a-1", "b-1", "dead-1"}
    assert after == {"a-2", "b-2"}


class Forgetting(FirstByName):
    """Records the endpoints the gateway tells it to forget."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.forgotten.append(endpoint_id)


def closed_ports(n: int) -> list[int]:
    """Ports nothing listens on (where discovery alone is watched, nothing needs to answer)."""
    ports = []
    for _ in range(n):
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            ports.append(closed.getsockname()[1])
    return ports


async def told_to_forget(policy: Forgetting) -> None:
    """Wait up to 2 s for the policy to be told to forget an endpoint (on the decision thread, soon after)."""
    for _ in range(200):
        if policy.forgotten:
            return
        await asyncio.sleep(0.01)


def test_the_policy_is_told_of_endpoints_discovery_no_longer_lists(tmp_path: Path) -> None:
    """Regression: the policy kept per-endpoint entries (when each endpoint was last sent a request, last heard
    from) for every pod name it ever saw: with each rollout they grew, and nothing told it a pod had gone."""
    path = tmp_path / "endpoints.json"
    policy = Forgetting()

    async def go() -> None:
        ports = closed_ports(3)
        write_endpoints(path, {"a-1": ports[0], "b-1": ports[1]})
        gateway = Gateway(FileDiscovery(path), policy, GatewaySettings(discovery_poll_s=0.02))  # type: ignore[arg-type]
        await gateway.start()
        try:
            while set(gateway.scraper.scrapes) != {"a-1", "b-1"}:
                await asyncio.sleep(0.01)
            write_endpoints(path, {"a-2": ports[2], "b-1": ports[1]})
            while set(gateway.scraper.scrapes) != {"a-2", "b-1"}:
                await asyncio.sleep(0.01)
            await told_to_forget(policy)
        finally:
            await gateway.stop()

    asyncio.run(go())
    assert policy.forgotten == ["a-1"]


def test_an_endpoint_back_under_its_name_at_another_address_starts_afresh(tmp_path: Path) -> None:
    """A pod recreated under its StatefulSet name comes back at a new IP with an empty KV cache: the gateway went on
    crediting it with the old server's prefix hits (and the policy with what it last sent there), until the LRU
    pushed them out; a time-out the old server earned kept the new one out of routing."""
    path = tmp_path / "endpoints.json"
    policy = Forgetting()

    async def go() -> tuple[int, int, bool]:
        ports = closed_ports(3)
        write_endpoints(path, {"a-1": ports[0], "b-1": ports[1]})
        gateway = Gateway(FileDiscovery(path), policy, GatewaySettings(discovery_poll_s=0.02))  # type: ignore[arg-type]
        key = gateway.affinity.key("You are a helpful assistant. " * 40)
        await gateway.start()
        try:
            while set(gateway.scraper.scrapes) != {"a-1", "b-1"}:
                await asyncio.sleep(0.01)
            for name in ("a-1", "b-1"):
                gateway.affinity.record(name, key)
            for _ in range(CONSECUTIVE_FAILURES):
                gateway.outliers.failed("a-1", "answered 500")
            assert gateway.outliers.out("a-1")
            write_endpoints(path, {"a-1": ports[2], "b-1": ports[1]})
            while gateway.scraper.scrapes["a-1"].endpoint.port != ports[2]:
                await asyncio.sleep(0.01)
            await told_to_forget(policy)
        finally:
            await gateway.stop()
        return (
            gateway.affinity.hit_tokens("a-1", key),
            gateway.affinity.hit_tokens("b-1", key),
            gateway.outliers.out("a-1"),
        )

    moved, stayed, out = asyncio.run(go())
    assert moved == 0 and stayed > 0
    assert not out
    assert policy.forgotten == ["a-1"]


@pytest.mark.parametrize("rendered_while_gone", [True, False])
def test_an_endpoint_name_that_comes_back_counts_its_new_scrape_errors_from_zero(
    tmp_path: Path, rendered_while_gone: bool
) -> None:
    """The gateway counted a name's scrape errors past those it had seen: a name back in discovery (a pod recreated
    under its StatefulSet name) starts a new count at 0, and none of its errors were counted until they passed the
    old count. So too when no /metrics was read while it was gone."""
    path = tmp_path / "endpoints.json"

    async def go() -> tuple[float, float, int]:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
        write_endpoints(path, {"dead": dead})
        gateway = Gateway(FileDiscovery(path), FirstByName(), GatewaySettings(discovery_poll_s=0.02))  # type: ignore[arg-type]
        gateway.scraper.interval_s = 0.005
        await gateway.start()
        try:
            while gateway.scraper.scrapes["dead"].errors < 20:
                await asyncio.sleep(0.01)
            first = count(parse_samples(gateway._render_metrics().decode()), "leadtime_router_scrape_errors_total")
            write_endpoints(path, {})
            while gateway.scraper.scrapes:
                await asyncio.sleep(0.01)
            if rendered_while_gone:
                gateway._render_metrics()
            gateway.scraper.interval_s = 10.0  # from now on, one scrape: far fewer errors than before
            write_endpoints(path, {"dead": dead})
            while "dead" not in gateway.scraper.scrapes or gateway.scraper.scrapes["dead"].errors == 0:
                await asyncio.sleep(0.01)
            again = count(parse_samples(gateway._render_metrics().decode()), "leadtime_router_scrape_errors_total")
            errors = gateway.scraper.scrapes["dead"].errors
        finally:
            await gateway.stop()
        return first, again, errors

    first, again, errors = asyncio.run(go())
    assert first >= 20
    assert errors == 1
    assert again == (errors if rendered_while_gone else first + errors)  # not read while gone: the series went on
