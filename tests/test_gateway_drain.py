"""Stopping `leadtime route` while a request hangs on a frozen endpoint: the drain is bounded and said."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from raw_endpoint import STREAM_HEAD, next_request
from threaded_server import Handler, serve_in_a_thread

from leadtime.bench.procs import Route


async def frozen_endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /metrics; starts a completion's stream and then says nothing more (a stopped process)."""
    if await next_request(reader, writer) is None:
        return
    writer.write(STREAM_HEAD)
    await writer.drain()
    await reader.read()  # nothing more, until the gateway hangs up


ONE_TOKEN = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'


async def stalling_endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /metrics; streams one token of a completion and then nothing more (a long answer, slow to come)."""
    if await next_request(reader, writer) is None:
        return
    writer.write(STREAM_HEAD + b"%x\r\n%s\r\n" % (len(ONE_TOKEN), ONE_TOKEN))
    await writer.drain()
    await reader.read()


def serve_frozen(handler: Handler = frozen_endpoint) -> tuple[int, asyncio.AbstractEventLoop]:
    return serve_in_a_thread(handler)


def test_a_stop_with_a_request_stuck_on_a_frozen_endpoint_ends_after_the_drain(tmp_path: Path) -> None:
    """SIGTERM waited for the endpoint's 600 s read timeout, a second SIGTERM did nothing, and nothing was logged."""
    port, loop = serve_frozen()
    route = Route(
        tmp_path, ["--endpoint", f"127.0.0.1:{port},name=frozen", "--policy", "round-robin", "--drain-s", "1"]
    )
    try:
        route.wait()
        body = {"prompt": "never answered", "max_tokens": 5, "stream": True}

        def ask() -> None:
            with contextlib.suppress(httpx.HTTPError):  # cut at the end of the drain: what is expected here
                httpx.post(f"{route.url}/v1/completions", json=body, timeout=60)

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        deadline = time.monotonic() + 10
        while route.metric("leadtime_router_inflight_requests") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert route.metric("leadtime_router_inflight_requests") == 1
        stopped = time.monotonic()
        route.child.process.send_signal(signal.SIGTERM)
        route.child.process.wait(timeout=20)
        assert time.monotonic() - stopped < 10
        log = route.child.output()
        assert "stopping: 1 request in flight, finishing it for at most 1 s" in log, log
        assert "open to any client that reaches it (no --api-key)" in log  # said at start
    finally:
        route.child.stop()
        loop.call_soon_threadsafe(loop.stop)


def stopped_during_a_request(
    tmp_path: Path, endpoint: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
) -> tuple[str, int, str]:
    """SIGTERM to a gateway (`--drain-s 1`) with a streaming request to `endpoint` in flight: its log, and the
    status and body its client got."""
    port, loop = serve_frozen(endpoint)
    route = Route(tmp_path, ["--endpoint", f"127.0.0.1:{port},name=slow", "--policy", "round-robin", "--drain-s", "1"])
    try:
        route.wait()
        body = {"prompt": "a long answer", "max_tokens": 3000, "stream": True}
        status: list[int] = []
        received: list[str] = []

        def ask() -> None:
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream("POST", f"{route.url}/v1/completions", json=body, timeout=60) as response,
            ):
                status.append(response.status_code)
                received.extend(response.iter_text())

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        deadline = time.monotonic() + 10
        while route.metric("leadtime_router_inflight_requests") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the request sent on
        route.child.process.send_signal(signal.SIGTERM)
        route.child.process.wait(timeout=20)
        client.join(10)
        return route.child.output(), status[0] if status else 0, "".join(received)
    finally:
        route.child.stop()
        loop.call_soon_threadsafe(loop.stop)


def test_a_stream_cut_at_the_end_of_the_drain_ends_with_an_error_event_and_no_traceback(tmp_path: Path) -> None:
    """At the drain's end uvicorn cancelled the request's task: it logged `Cancel 1 running task(s)` (and at times
    a traceback ending in CancelledError), and the client's stream stopped without an error event or `[DONE]`, as
    if whole."""
    log, status, text = stopped_during_a_request(tmp_path, stalling_endpoint)
    assert "stopping: 1 request in flight, finishing it for at most 1 s" in log, log
    assert "cut 1 request still in flight" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert status == 200
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[0] == ONE_TOKEN.decode().strip()
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "stopping" in error["message"], error


async def silent_endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /metrics; takes a completion and never answers it."""
    if await next_request(reader, writer) is None:
        return
    await reader.read()


def test_a_request_cut_before_its_answer_started_gets_a_503(tmp_path: Path) -> None:
    """Cut while waiting for its endpoint to answer, a request is answered 503 (try again), with no traceback."""
    log, status, text = stopped_during_a_request(tmp_path, silent_endpoint)
    assert "cut 1 request still in flight" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert status == 503
    assert "stopping" in json.loads(text)["error"]["message"]


def test_sighup_is_ignored_with_a_log_line_and_the_gateway_goes_on_serving(tmp_path: Path) -> None:
    """SIGHUP ended the gateway at once: no drain, no log line. It has nothing to reload (its --config is read once
    at start; the discovery and time-slice files are re-read when they change), so it says so and goes on."""
    port, loop = serve_frozen()
    route = Route(tmp_path, ["--endpoint", f"127.0.0.1:{port},name=frozen", "--policy", "round-robin"])
    try:
        route.wait()
        route.child.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "SIGHUP" not in route.child.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert route.child.process.poll() is None, route.child.output()
        assert httpx.get(f"{route.url}/readyz", timeout=5).status_code == 200
        log = [line for line in route.child.output().splitlines() if "SIGHUP" in line]
        assert len(log) == 1 and "ignored" in log[0] and "--config is read once" in log[0], log
        route.child.process.send_signal(signal.SIGTERM)
        route.child.process.wait(timeout=20)  # SIGTERM still stops it, with its drain
        assert "stopping" in route.child.output()
    finally:
        route.child.stop()
        loop.call_soon_threadsafe(loop.stop)
