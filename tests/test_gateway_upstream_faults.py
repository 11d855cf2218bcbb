"""Endpoints that answer in ways HTTP allows rarely or not at all: a malformed response, an upgrade nobody asked
for, silence in the middle of a body, a body that ends when the connection closes. The client must get an answer
that says what happened (or the whole body), the gateway's log and counters must name the endpoint, and the gateway
must carry on, its accounting of the work in flight released."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from raw_endpoint import STREAM_HEAD, gateway_in_front, next_request

from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings

Writer = asyncio.StreamWriter
Answer = Callable[[asyncio.StreamReader, Writer], Awaitable[None]]
Scenario = Callable[[httpx.AsyncClient], Awaitable[Any]]

ONE_TOKEN = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'
WHOLE_STREAM = ONE_TOKEN + b'data: {"choices":[{"index":0,"text":" b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def answers_well(reader: asyncio.StreamReader, writer: Writer) -> None:
    writer.write(STREAM_HEAD + chunked(WHOLE_STREAM) + b"0\r\n\r\n")


async def garbage(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Not HTTP at all (a port serving something else)."""
    writer.write(b"GARBAGE NOT HTTP\r\n\r\n")


def endpoint(*answers: Answer) -> Callable[[asyncio.StreamReader, Writer], Awaitable[None]]:
    """An endpoint answering /metrics idle and the requests sent on with `answers` in turn (the last one again and
    again); an answer that returns leaves the connection open for the next request."""
    queue = list(answers)

    async def handle(reader: asyncio.StreamReader, writer: Writer) -> None:
        with contextlib.suppress(ConnectionError):
            while await next_request(reader, writer) is not None:
                answer = queue.pop(0) if len(queue) > 1 else queue[0]
                await answer(reader, writer)
                if writer.is_closing():
                    return
                await writer.drain()

    return handle


def through(
    handler: Callable[[asyncio.StreamReader, Writer], Awaitable[None]],
    scenario: Scenario,
    settings: GatewaySettings | None = None,
) -> tuple[Any, dict[str, Any], Gateway]:
    """`scenario(client)` through an in-process gateway in front of the endpoint `handler`; what it returned, the
    gateway's metrics after it, and the gateway (stopped)."""

    async def go() -> tuple[Any, dict[str, Any], Gateway]:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1], settings) as gateway:
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                    result = await scenario(client)
                    samples = parse_samples((await client.get("/metrics")).text)
                assert gateway.in_flight == 0
                assert gateway.work.tokens("e-0", published_ms=float("inf")) == (0, 0)
                return result, samples, gateway
        finally:
            server.close()

    return asyncio.run(go())


def count(samples: dict[str, Any], name: str, **labels: str) -> float:
    return sum(v for got, v in samples.get(name, []) if all(got.get(k) == want for k, want in labels.items()))


def completions(*bodies: dict[str, Any]) -> Scenario:
    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post("/v1/completions", json=body) for body in bodies]

    return scenario


STREAMING = {"prompt": "hi", "max_tokens": 2, "stream": True}
NON_STREAMING = {"prompt": "hi", "max_tokens": 2}


def test_a_malformed_response_is_logged_naming_the_endpoint_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """An endpoint answering `GARBAGE NOT HTTP` (real Prometheus text to its scrapes): each request got a 503 "no
    other endpoint to retry on", and no line of the log at INFO or above said why."""
    with caplog.at_level(logging.INFO):
        responses, samples, _ = through(endpoint(garbage), completions(STREAMING, NON_STREAMING, STREAMING))
    for response in responses:
        assert response.status_code == 503
        assert "no other endpoint to retry on" in response.json()["error"]["message"]
    said = [r for r in caplog.records if "malformed response" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # once, not at every request
    assert said[0].levelno == logging.WARNING and "e-0" in said[0].getMessage()
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="e-0", kind="malformed") == 3
    assert count(samples, "leadtime_router_requests_total", path="/v1/completions", code="503") == 3


def test_a_malformed_response_is_warned_again_after_the_endpoint_served_well(caplog: pytest.LogCaptureFixture) -> None:
    handler = endpoint(garbage, answers_well, garbage, answers_well)
    with caplog.at_level(logging.INFO):
        responses, samples, _ = through(handler, completions(STREAMING, STREAMING, STREAMING, STREAMING))
    assert [r.status_code for r in responses] == [503, 200, 503, 200]
    said = [r.getMessage() for r in caplog.records if "malformed response" in r.getMessage()]
    assert len(said) == 2, said
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="e-0", kind="malformed") == 2


async def stalls_mid_stream(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Streams one token, then says nothing more until the gateway hangs up (a frozen process)."""
    writer.write(STREAM_HEAD + chunked(ONE_TOKEN))
    await writer.drain()
    await reader.read()


async def stalls_mid_json(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Answers whole JSON (as to a request it would not stream), the first of its 100 bytes only."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
    await writer.drain()
    await reader.read()


def events(text: str) -> list[Any]:
    """The payloads of a stream's events, JSON decoded (but `[DONE]`)."""
    payloads = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_an_endpoint_silent_mid_stream_ends_the_stream_with_an_error_after_the_upstream_timeout() -> None:
    """Silence between two pieces of an answer longer than `--upstream-timeout-s`: the client's stream ends with the
    error event naming the endpoint and `[DONE]` (after the token it had), and the next request is served."""

    async def scenario(client: httpx.AsyncClient) -> tuple[list[httpx.Response], float]:
        started = asyncio.get_running_loop().time()
        first = await client.post("/v1/completions", json=STREAMING)
        took_s = asyncio.get_running_loop().time() - started
        return [first, await client.post("/v1/completions", json=STREAMING)], took_s

    handler = endpoint(stalls_mid_stream, answers_well)
    ((cut, served), took_s), samples, _ = through(handler, scenario, GatewaySettings(upstream_timeout_s=0.3))
    assert 0.3 <= took_s < 3.0  # was 600 s by default
    assert cut.status_code == 200
    token, error, done = events(cut.text)
    assert token["choices"][0]["text"] == " a" and done == "[DONE]"
    assert error["error"]["code"] == 502
    assert error["error"]["message"] == "endpoint e-0 failed mid-stream: timeout: no data for 0.3 s"
    assert served.status_code == 200
    assert [e["choices"][0]["text"] for e in events(served.text)[:-1]] == [" a", " b"]
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="e-0", kind="timeout") == 1
    assert count(samples, "leadtime_router_requests_total", path="/v1/completions", code="502") == 1
    assert count(samples, "leadtime_router_requests_total", path="/v1/completions", code="200") == 1


@pytest.mark.parametrize("stall", [stalls_mid_stream, stalls_mid_json], ids=["measured-stream", "whole-json"])
def test_an_endpoint_silent_mid_body_answers_a_non_streaming_request_502(stall: Answer) -> None:
    """A non-streaming request (sent on as a stream to be measured, or answered whole): a 502 naming the endpoint
    and the silence, not an answer cut short; the next request is served."""
    handler = endpoint(stall, answers_well)
    settings = GatewaySettings(upstream_timeout_s=0.3)
    (failed, served), samples, _ = through(handler, completions(NON_STREAMING, NON_STREAMING), settings)
    assert failed.status_code == 502
    assert failed.headers["x-leadtime-endpoint"] == "e-0"
    assert failed.json()["error"]["message"] == "endpoint e-0 failed: timeout: no data for 0.3 s"
    assert served.status_code == 200
    assert served.json()["choices"][0]["text"] == " a b"
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="e-0", kind="timeout") == 1


COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "m",
    "choices": [{"index": 0, "text": " a b", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}


def until_close(content_type: bytes, body: bytes) -> Answer:
    """An answer with neither a length nor chunks: its body ends when the endpoint closes the connection."""

    async def answer(reader: asyncio.StreamReader, writer: Writer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\n\r\n" % content_type)
        for i in range(0, len(body), 7):  # in pieces, some of them apart
            writer.write(body[i : i + 7])
            if i % 21 == 0:
                await writer.drain()
                await asyncio.sleep(0.005)
        await writer.drain()
        writer.close()

    return answer


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"], ids=["routed", "passed-through"])
def test_a_body_ended_by_the_connection_closing_is_delivered_whole(path: str) -> None:
    whole = json.dumps(COMPLETION).encode()

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post(path, json={**NON_STREAMING, "input": "hi"}) for _ in range(2)]

    responses, samples, _ = through(endpoint(until_close(b"application/json", whole)), scenario)
    for response in responses:  # the second on a new connection: the first ended with its own
        assert response.status_code == 200
        assert response.content == whole
        assert response.headers["x-leadtime-endpoint"] == "e-0"
    assert count(samples, "leadtime_router_upstream_errors_total") == 0
    assert count(samples, "leadtime_router_upstream_responses_total", endpoint="e-0", status="2xx") == 2
    assert count(samples, "leadtime_router_requests_total", path=path, code="200") == 2


def test_a_stream_ended_by_the_connection_closing_is_delivered_whole_and_learned() -> None:
    responses, samples, gateway = through(
        endpoint(until_close(b"text/event-stream", WHOLE_STREAM)), completions(STREAMING, STREAMING)
    )
    for response in responses:
        assert response.status_code == 200
        *tokens, done = events(response.text)
        assert [t["choices"][0]["text"] for t in tokens] == [" a", " b"] and done == "[DONE]"
    assert count(samples, "leadtime_router_upstream_errors_total") == 0
    assert count(samples, "leadtime_router_ttft_seconds_count", kind="actual") == 2  # a whole answer, measured


async def upgrades(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Switches to another protocol, which nobody asked for."""
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n")


@pytest.mark.parametrize("body", [STREAMING, NON_STREAMING], ids=["streaming", "non-streaming"])
def test_an_unexpected_upgrade_fails_the_request_before_its_answer_and_is_said(
    body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing was answered: the request is decided again (no other endpoint here: a 503), the endpoint named in
    the log and counted; it serves the next request on a new connection."""
    with caplog.at_level(logging.INFO):
        (failed, served), samples, _ = through(endpoint(upgrades, answers_well), completions(body, body))
    assert failed.status_code == 503
    assert "no other endpoint to retry on" in failed.json()["error"]["message"]
    assert served.status_code == 200
    (said,) = [r.getMessage() for r in caplog.records if "unexpected upgrade" in r.getMessage()]
    assert said.startswith("endpoint e-0 sent an unexpected upgrade")
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="e-0", kind="upgrade") == 1
    assert count(samples, "leadtime_router_retries_total") == 1
