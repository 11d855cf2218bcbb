"""Endpoints that answer in ways HTTP allows rarely or not at all: a malformed response, an upgrade nobody asked
for, silence in the middle of a body, a body that ends when the connection closes. The client must get an answer
that says what happened (or the whole body), the gateway's log and counters must name the endpoint, and the gateway
must carry on, its accounting of the work in flight released."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from raw_endpoint import STREAM_HEAD, gateway_in_front, next_request
from threaded_server import serve_in_a_thread

from leadtime.bench.procs import Route
from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.gateway import upstream
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.client_watch import ClientLeft, ClientWatch
from leadtime.router_plugin.gateway.upstream import UpstreamError, UpstreamPool

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
        # cancelled as the test's loop ends, with a connection open: quietly (asyncio logs a cancelled handler)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
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
        message = response.json()["error"]["message"]
        assert "endpoint e-0 failed before answering (malformed: malformed response" in message, message
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
    """Nothing was answered: the request would be decided again (no other endpoint here: a 503 naming it), the
    endpoint named in the log and counted; it serves the next request on a new connection."""
    with caplog.at_level(logging.INFO):
        (failed, served), samples, _ = through(endpoint(upgrades, answers_well), completions(body, body))
    assert failed.status_code == 503
    assert "endpoint e-0 failed before answering (upgrade: unexpected upgrade)" in failed.json()["error"]["message"]
    assert served.status_code == 200
    (said,) = [r.getMessage() for r in caplog.records if "unexpected upgrade" in r.getMessage()]
    assert said.startswith("endpoint e-0 sent an unexpected upgrade")
    assert count(samples, "leadtime_router_upstream_errors_total", endpoint="e-0", kind="upgrade") == 1
    assert count(samples, "leadtime_router_retries_total") == 0  # none was sent


async def silent(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Says nothing until the gateway hangs up (a stopped process)."""
    await reader.read()


async def drops(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Reads the request and closes the connection without a word (it crashed on it)."""
    writer.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"], ids=["routed", "passed-through"])
@pytest.mark.parametrize(
    ("answer", "cause"),
    [(drops, "reset: connection closed (by the endpoint)"), (silent, "timeout: no response within 0.3 s")],
    ids=["reset", "timeout"],
)
def test_the_only_endpoint_failing_before_answering_is_named_with_how_and_no_retry_is_counted(
    answer: Answer, cause: str, path: str
) -> None:
    """Regression: with no other endpoint to try, a request whose endpoint failed before answering got a 503 "no
    other endpoint to retry on": which endpoint failed, and how (a reset, a timeout after --upstream-timeout-s, a
    refused connection), was said nowhere but in counters, and `retries_total` counted a retry never sent."""

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post(path, json=STREAMING)]

    settings = GatewaySettings(upstream_timeout_s=0.3)
    (response,), samples, _ = through(endpoint(answer), scenario, settings)
    assert response.status_code == 503 and response.headers["x-leadtime-endpoint"] == "e-0"
    assert response.json()["error"]["message"] == (
        f"no endpoint can serve this request now: endpoint e-0 failed before answering ({cause}), and no other "
        "endpoint is left to retry on"
    )
    assert count(samples, "leadtime_router_retries_total") == 0


def streams_slowly(closed: asyncio.Event, sent: list[int]) -> Answer:
    """Streams up to 200 tokens, one every 20 ms, counting them in `sent`; sets `closed` once the gateway hangs
    up."""

    async def answer(reader: asyncio.StreamReader, writer: Writer) -> None:
        writer.write(STREAM_HEAD)
        try:
            for _ in range(200):
                writer.write(chunked(ONE_TOKEN))
                await writer.drain()
                sent.append(1)
                await asyncio.sleep(0.02)
        except ConnectionError:
            pass
        closed.set()
        writer.close()

    return answer


async def asgi_post(
    gateway: Gateway, body: dict[str, Any], leave_after: int | None
) -> tuple[list[MutableMapping[str, Any]], float | None, tuple[int, int]]:
    """POST `body` to /v1/completions straight to the gateway's ASGI interface, the client hanging up once
    `leave_after` pieces of the body reached it (None: never); what it was sent, how long the gateway went on
    after the client left, and the work in flight the gateway counted on e-0 as the client left."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[MutableMapping[str, Any]] = []
    enough = asyncio.Event()
    left: list[float] = []
    counted: list[tuple[int, int]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        if leave_after is None:
            await asyncio.Event().wait()  # never: cancelled when the gateway is done with it
        await enough.wait()
        counted.append(gateway.work.tokens("e-0", published_ms=float("inf")))
        left.append(asyncio.get_running_loop().time())
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if leave_after is not None and sum(m["type"] == "http.response.body" for m in sent) >= leave_after:
            enough.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": []}
    await asyncio.wait_for(gateway(scope, receive, send), timeout=10)
    after_s = asyncio.get_running_loop().time() - left[0] if left else None
    return sent, after_s, counted[0] if counted else (0, 0)


def test_a_client_that_hangs_up_mid_stream_is_let_go_and_its_work_released(caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint still streaming: the gateway notices the client left, closes the endpoint's connection (vLLM
    aborts the request), counts a 499, releases the request's tokens in flight, says no traceback, and serves the
    next request."""

    async def go() -> tuple[Any, ...]:
        closed = asyncio.Event()
        streamed: list[int] = []
        handler = endpoint(streams_slowly(closed, streamed), answers_well)
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                sent, after_s, working = await asgi_post(gateway, STREAMING, leave_after=3)
                await asyncio.wait_for(closed.wait(), timeout=5)
                in_flight, left_over = gateway.in_flight, gateway.work.tokens("e-0", published_ms=float("inf"))
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                    served = await client.post("/v1/completions", json=STREAMING)
                    samples = parse_samples((await client.get("/metrics")).text)
                return sent, after_s, working, len(streamed), in_flight, left_over, served, samples
        finally:
            server.close()

    with caplog.at_level(logging.DEBUG, logger="leadtime"):
        sent, after_s, working, streamed, in_flight, left_over, served, samples = asyncio.run(go())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert all(m.get("more_body") for m in sent[1:])  # nothing more was sent to a client that is gone
    assert working[1] > 0  # its prompt and tokens were counted as decode work on e-0 ...
    assert in_flight == 0 and left_over == (0, 0)  # ... and released once it left
    assert after_s is not None and after_s < 1.0
    assert streamed < 100  # the endpoint stopped long before its 200 tokens
    assert served.status_code == 200
    assert count(samples, "leadtime_router_requests_total", path="/v1/completions", code="499") == 1
    assert count(samples, "leadtime_router_upstream_errors_total") == 0  # the client's leaving is not the endpoint's
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize("answer", [stalls_mid_stream, silent], ids=["mid-stream", "before-answering"])
def test_a_request_cut_at_the_end_of_the_drain_is_told_so(answer: Answer) -> None:
    """`Gateway.cut` (the drain is over) while the endpoint is frozen: a stream ends with the 503 error event and
    `[DONE]`; a request not answered yet gets a 503 saying to try again."""

    async def go() -> tuple[list[MutableMapping[str, Any]], int, int]:
        server = await asyncio.start_server(endpoint(answer), "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                request = asyncio.ensure_future(asgi_post(gateway, STREAMING, leave_after=None))
                await asyncio.sleep(0.3)
                cut = gateway.cut()
                sent, _, _ = await request
                return sent, cut, gateway.in_flight
        finally:
            server.close()

    sent, cut, in_flight = asyncio.run(go())
    assert cut == 1 and in_flight == 0
    start, *pieces = sent
    assert start["status"] == (503 if answer is silent else 200)
    text = b"".join(m.get("body", b"") for m in pieces).decode()
    if answer is silent:
        assert "the gateway is stopping" in json.loads(text)["error"]["message"]
    else:
        token, error, done = events(text)
        assert token["choices"][0]["text"] == " a" and done == "[DONE]"
        assert error["error"]["code"] == 503 and "the gateway is stopping" in error["error"]["message"]


def test_a_race_cancelled_from_outside_cancels_its_work() -> None:
    """A stop cancels the request's task while it races its client: the endpoint's call goes with it, not left
    running for nobody."""

    async def go() -> tuple[bool, bool]:
        work = asyncio.ensure_future(asyncio.sleep(30))
        watch = ClientWatch(asyncio.Event().wait)  # a client that stays
        racing = asyncio.ensure_future(watch.race(work))
        await asyncio.sleep(0.01)
        racing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await racing
        await asyncio.sleep(0)
        watch.close()
        return racing.cancelled(), work.cancelled()

    assert asyncio.run(go()) == (True, True)


def test_a_cut_lets_the_request_go_as_a_leaving_client_does_and_says_so() -> None:
    async def go() -> tuple[bool, bool, bool, bool]:
        watch = ClientWatch(asyncio.Event().wait)
        watch.cut()  # before anything waited on the client
        work = asyncio.ensure_future(asyncio.sleep(30))
        try:
            await watch.race(work)
        except ClientLeft:
            left = True
        else:
            left = False
        await asyncio.sleep(0)
        return watch.was_cut, watch.left(), left, work.cancelled()

    assert asyncio.run(go()) == (True, True, True, True)


def test_a_cut_after_the_client_left_is_nobody_to_tell() -> None:
    async def go() -> tuple[bool, bool]:
        async def gone() -> dict[str, str]:
            return {"type": "http.disconnect"}

        watch = ClientWatch(gone)
        assert await watch.wait(1.0)
        watch.cut()
        return watch.was_cut, watch.left()

    assert asyncio.run(go()) == (False, True)


def closes_reused_connections(answer_new_ones: bool) -> tuple[Callable[..., Awaitable[None]], list[int]]:
    """An endpoint that answers the first request of each connection and closes a connection sent a second one
    without a word (its keep-alive timeout passed as the request was on its way); from the second connection on, it
    answers nothing at all unless `answer_new_ones`. Counts its connections."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: Writer) -> None:
        connections.append(1)
        for served in range(2):
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if served or (len(connections) > 1 and not answer_new_ones):
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    return handle, connections


def test_a_reused_connection_closed_before_answering_is_retried_once_on_a_new_one() -> None:
    async def go(answer_new_ones: bool) -> tuple[list[Any], int]:
        handle, connections = closes_reused_connections(answer_new_ones)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
        got: list[Any] = []
        try:
            for _ in range(2):
                try:
                    response = await pool.request("GET", "/", timeout_s=2.0)
                    got.append((response.status, await response.read(2.0)))
                except UpstreamError as err:
                    got.append((err.kind, err.responded))
        finally:
            pool.close()
            server.close()
        return got, len(connections)

    assert asyncio.run(go(True)) == ([(200, b"ok"), (200, b"ok")], 2)
    # the new connection fails too: no third try, the request's failure is said (nothing was answered)
    assert asyncio.run(go(False)) == ([(200, b"ok"), ("reset", False)], 2)


def drops_posts(heads: list[bytes]) -> Callable[..., Awaitable[None]]:
    """An endpoint that answers a GET, and reads a POST whole and closes its connection without a word (a request
    that crashes it: a "query of death"); keeps the head of every request it read."""

    async def handle(reader: asyncio.StreamReader, writer: Writer) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while (head := await next_request(reader, writer)) is not None:
                heads.append(head)
                if head.startswith(b"POST"):
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

    return handle


def test_a_post_read_by_an_endpoint_that_dropped_its_connection_is_not_sent_again_by_the_pool() -> None:
    """Regression: on a reused connection, a POST the endpoint read and then closed the connection on was sent again
    on a new one (taken for an idle connection the endpoint had closed): a request that crashes its endpoint went to
    each endpoint twice, four sends for one client request. A GET is still sent again (nothing to repeat)."""

    async def go() -> tuple[list[bytes], tuple[str, bool]]:
        heads: list[bytes] = []
        server = await asyncio.start_server(drops_posts(heads), "127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            response = await pool.request("GET", "/", timeout_s=2.0)  # leaves its connection idle, to be reused
            assert await response.read(2.0) == b"ok"
            with pytest.raises(UpstreamError) as failed:
                await pool.request("POST", "/v1/completions", body=b"{}", timeout_s=2.0)
            return heads, (failed.value.kind, failed.value.responded)
        finally:
            pool.close()
            server.close()

    heads, failure = asyncio.run(go())
    assert [h.split(b" ")[0] for h in heads] == [b"GET", b"POST"]
    assert failure == ("reset", False)


def test_a_request_whose_endpoint_dropped_it_reaches_it_once() -> None:
    """Through the gateway, in front of one endpoint whose connection its scrapes keep in use: one send."""
    heads: list[bytes] = []
    (response,), _, _ = through(drops_posts(heads), completions(STREAMING))
    assert response.status_code == 503  # failed before answering, and no other endpoint to send it to
    assert len([h for h in heads if h.startswith(b"POST")]) == 1


def keeps_connections(connections: list[int]) -> Callable[..., Awaitable[None]]:
    """An endpoint answering every request of a connection, however many; counts its connections."""

    async def handle(reader: asyncio.StreamReader, writer: Writer) -> None:
        connections.append(1)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while await next_request(reader, writer) is not None:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

    return handle


@pytest.mark.parametrize(("idle_s", "connections"), [(0.0, 1), (0.3, 2)], ids=["reused", "idle-too-long"])
def test_a_connection_idle_as_long_as_endpoints_keep_one_is_not_reused(
    monkeypatch: pytest.MonkeyPatch, idle_s: float, connections: int
) -> None:
    """A POST is not sent again when its connection turns out closed (above): a connection idle for as long as
    vLLM's server keeps one before closing it is not used, so that no request goes out on one being closed."""
    monkeypatch.setattr(upstream, "IDLE_REUSE_S", 0.1)

    async def go() -> int:
        opened: list[int] = []
        server = await asyncio.start_server(keeps_connections(opened), "127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            for _ in range(2):
                response = await pool.request("POST", "/v1/completions", body=b"{}", timeout_s=2.0)
                assert await response.read(2.0) == b"ok"
                await asyncio.sleep(idle_s)
        finally:
            pool.close()
            server.close()
        return len(opened)

    assert asyncio.run(go()) == connections


CUT_JSON = b'{"data":[{"embedding":[' + b"0.1," * 25
WHOLE_JSON = b'{"prompt":"hi"}'


async def breaks_passed_through_bodies(reader: asyncio.StreamReader, writer: Writer) -> None:
    """Answers /metrics; `/detokenize` whole, framed by its length; `/v1/embeddings` with a length of 2000 bytes and
    `/tokenize` in chunks, each broken off (the connection reset) after the first 100 bytes of its JSON."""
    with contextlib.suppress(ConnectionError):
        while (head := await next_request(reader, writer)) is not None:
            if head.startswith(b"POST /detokenize"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(WHOLE_JSON), WHOLE_JSON))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            if head.startswith(b"POST /v1/embeddings"):
                writer.write(b"content-length: 2000\r\n\r\n" + CUT_JSON)
            else:
                writer.write(b"transfer-encoding: chunked\r\n\r\n" + chunked(CUT_JSON))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()
            return


def test_a_passed_through_answer_broken_off_mid_body_reaches_its_client_broken(tmp_path: Path) -> None:
    """Regression: an endpoint whose connection broke 100 bytes into a passed-through answer (`/v1/embeddings`,
    `/tokenize`): its client got a complete chunked 200 holding half a JSON document, nothing to tell it from a
    whole answer, while the gateway counted a 502. The client must see the body end before its end, as from any
    proxy; a body framed by its length keeps that length."""
    port, loop = serve_in_a_thread(breaks_passed_through_bodies)
    route = Route(tmp_path, ["--endpoint", f"127.0.0.1:{port},name=e-0", "--policy", "round-robin"])
    try:
        route.wait()
        for path in ("/v1/embeddings", "/tokenize"):
            with pytest.raises(httpx.RemoteProtocolError):  # h11: the connection closed before the body's end
                httpx.post(f"{route.url}{path}", json={"input": "x"}, timeout=10)
        whole = httpx.post(f"{route.url}/detokenize", json={"tokens": [1]}, timeout=10)
        assert whole.status_code == 200 and whole.content == WHOLE_JSON
        assert whole.headers["content-length"] == str(len(WHOLE_JSON)) and "transfer-encoding" not in whole.headers
        for path in ("/v1/embeddings", "/tokenize"):
            assert route.metric("leadtime_router_requests_total", path=path, code="502") == 1
        assert route.metric("leadtime_router_upstream_errors_total", endpoint="e-0", kind="reset") == 2
    finally:
        route.child.stop()
        loop.call_soon_threadsafe(loop.stop)
    assert "broke off its answer" in route.child.output()
