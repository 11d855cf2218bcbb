"""Stopping `leadtime route` while a request hangs on a frozen endpoint: the drain is bounded and said."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from pathlib import Path

import httpx
from raw_endpoint import STREAM_HEAD, next_request

from leadtime.bench.procs import Route


async def frozen_endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /metrics; starts a completion's stream and then says nothing more (a stopped process)."""
    if await next_request(reader, writer) is None:
        return
    writer.write(STREAM_HEAD)
    await writer.drain()
    await reader.read()  # nothing more, until the gateway hangs up


def serve_frozen() -> tuple[int, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    port: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(frozen_endpoint, "127.0.0.1", 0))
        port.append(server.sockets[0].getsockname()[1])
        started.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    started.wait(10)
    return port[0], loop


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
